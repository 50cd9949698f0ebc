//! Real containers (podman + runc, an image made here): the static executor bind-mounted
//! read-only as the entrypoint. A default container refuses namespaces, so the daemon must say
//! so and carry the load with landlock; a `--privileged` one can run strict. The host sees
//! every container process, and checks for survivors there.

mod locale;
mod no_bash;
mod privileged;
mod survivors;
mod unprivileged;

/// Command timeouts in the containers (they run at the host's speed).
pub const TIMEOUT: f64 = 5.0;
