//! Profiles the VM and container suites add to the shipped ones (`serve --profiles-dir`).

use std::path::Path;

/// The shipped profiles.
pub const SHIPPED: [&str; 4] = ["strict", "landlock", "task-container", "trusted"];

/// `serve` flags that offer every shipped profile and the `-small` ones: a daemon offers
/// `trusted` and host-writing profiles only when the operator names them, and the suites use
/// `trusted` as the control of their denials.
pub fn allow_every_profile() -> Vec<String> {
    let small = small_profiles().into_iter().map(|(name, _)| name);
    SHIPPED
        .iter()
        .map(|s| s.to_string())
        .chain(small)
        .flat_map(|name| ["--allow-profile".to_string(), name])
        .collect()
}

/// Profiles with small limits, next to the shipped ones: `<name>-small` for strict, landlock
/// and task-container with 64 processes and 128 MiB, so that a test reaches each limit in
/// seconds under emulation (the shipped 2 GiB would exceed the VM's memory first).
pub fn small_profiles() -> Vec<(String, String)> {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sandbox-profiles");
    ["strict", "landlock", "task-container"]
        .iter()
        .map(|base| {
            let text = std::fs::read_to_string(shipped.join(format!("{base}.json"))).unwrap();
            let mut profile: serde_json::Value = serde_json::from_str(&text).unwrap();
            let name = format!("{base}-small");
            profile["name"] = name.clone().into();
            profile["limits"]["processes"] = SMALL_PROCESSES.into();
            profile["limits"]["memory_mb"] = SMALL_MEMORY_MB.into();
            (name, serde_json::to_string_pretty(&profile).unwrap())
        })
        .collect()
}

/// Limits of the `-small` profiles.
pub const SMALL_PROCESSES: u64 = 64;
pub const SMALL_MEMORY_MB: u64 = 128;
