//! `agent deploy`: start one executor for another client (`up`), remove leftovers (`reap`).

use clap::Subcommand;

#[derive(Subcommand)]
pub enum DeployCommand {
    /// Start one executor, print how to reach it as one JSON line, and tear it down when
    /// stdin closes (or on SIGTERM/SIGINT).
    Up(Box<super::up::UpArgs>),
    /// Write Kubernetes manifests (a Pod per task; agent-sandbox templates), not applied.
    K8s(Box<super::k8s::K8sArgs>),
    /// Remove the containers a killed agent left behind (by label).
    Reap(super::reap::ReapArgs),
}

pub async fn dispatch(command: DeployCommand) -> anyhow::Result<u8> {
    match command {
        DeployCommand::Up(args) => super::up::command(*args).await,
        DeployCommand::K8s(args) => super::k8s::command(*args).await,
        DeployCommand::Reap(args) => super::reap::command(args).await,
    }
}
