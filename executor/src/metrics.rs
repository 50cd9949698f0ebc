//! The daemon's Prometheus metrics, served at `GET /metrics` in the OpenMetrics text format.
//!
//! One [`Metrics`] lives in the daemon. Connections call it at a few points: a connection
//! opens, a command is admitted, refused, finished or fails to start. Every label value comes
//! from a bounded set: `client` is a client name of the daemon's configuration, `profile` a
//! loaded profile, `outcome`, `code` and `limit` come from fixed lists. A request never chooses
//! a label value freely, so no client can grow the exposition (an unknown profile it asks for
//! is refused, and a refusal carries no profile).
//!
//! The text is encoded by `prometheus-client`, the official Rust client, not formatted here.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use protocol::{Ending, ErrorCode, ExecResult};

/// Content type of the text [`Metrics::render`] returns.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `outcome` of a request answered with an error instead of running.
const REFUSED: &str = "refused";
/// `outcome` of an admitted command whose run failed (its sandbox could not be set up).
const ERROR: &str = "error";

/// Upper bounds of the duration buckets in seconds, from a `true` (1 ms) to a long build or
/// test suite (an hour): steps of 1-2.5-5 up to 10 s, then minutes. Round numbers keep the
/// `le` labels short, which the terms of a power series (0.001 * 2^n) would not be in floating
/// point.
const DURATION_BUCKETS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClientLabels {
    client: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabels {
    client: String,
    profile: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    client: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    client: String,
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProfileLabels {
    profile: String,
}

fn client(client: &str) -> ClientLabels {
    ClientLabels {
        client: client.to_string(),
    }
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// Every metric of the daemon and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    commands: Family<CommandLabels, Counter>,
    durations: Family<ProfileLabels, Histogram, fn() -> Histogram>,
    in_flight: Family<ClientLabels, Gauge>,
    connections_open: Gauge,
    connections: Family<ClientLabels, Counter>,
    output_bytes: Family<ClientLabels, Counter>,
    refusals: Family<CodeLabels, Counter>,
    errors: Family<CodeLabels, Counter>,
    limit_hits: Family<LimitLabels, Counter>,
    network: crate::enforce::log::Counters,
    memory: MemoryGauges,
}

/// The memory budget's gauges (`budget.rs` keeps them current).
#[derive(Clone, Default)]
pub struct MemoryGauges {
    budget: Gauge,
    kept: Gauge,
    client_kept: Family<ClientLabels, Gauge>,
}

impl MemoryGauges {
    pub fn set_budget(&self, bytes: u64) {
        self.budget.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    pub fn set_kept(&self, bytes: u64) {
        self.kept.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    pub fn set_client_kept(&self, client: &str, bytes: u64) {
        self.client_kept
            .get_or_create(&self::client(client))
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // Help texts get their full stop from the encoder; counters their `_total`, and
        // metrics registered with a unit its name (`_seconds`, `_bytes`).
        let mut registry = Registry::with_prefix("executor");
        let commands = Family::<CommandLabels, Counter>::default();
        registry.register(
            "commands",
            "Commands by client, profile and outcome: how a result ended (exited, signaled, \
             timed_out, cancelled, disconnected, shutdown), error when an admitted command \
             could not be run, refused when the request was answered with an error before \
             running (refusals carry no profile)",
            commands.clone(),
        );
        let durations = Family::<ProfileLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        registry.register_with_unit(
            "command_duration",
            "Wall-clock time of finished commands from spawn to result, by profile",
            Unit::Seconds,
            durations.clone(),
        );
        let in_flight = Family::<ClientLabels, Gauge>::default();
        registry.register(
            "commands_in_flight",
            "Commands admitted and not yet finished, by client",
            in_flight.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Open authenticated WebSocket connections",
            connections_open.clone(),
        );
        let connections = Family::<ClientLabels, Counter>::default();
        registry.register(
            "connections",
            "Authenticated WebSocket connections opened, by client",
            connections.clone(),
        );
        let output_bytes = Family::<ClientLabels, Counter>::default();
        registry.register_with_unit(
            "output",
            "Bytes of output commands wrote, by client: the true count, including bytes \
             elided from results",
            Unit::Bytes,
            output_bytes.clone(),
        );
        let refusals = Family::<CodeLabels, Counter>::default();
        registry.register(
            "refusals",
            "Command requests refused before running, by client and error code",
            refusals.clone(),
        );
        let errors = Family::<CodeLabels, Counter>::default();
        registry.register(
            "command_errors",
            "Admitted commands that could not be run, by client and error code",
            errors.clone(),
        );
        let limit_hits = Family::<LimitLabels, Counter>::default();
        registry.register(
            "limit_hits",
            "Limits commands ran into, by client and limit: processes and memory (cgroup \
             limits of the profile), timeout, output (the output kept was cut to its head and \
             tail); and memory_budget_connection_shed: a connection dropped to give its grown \
             read buffer back to the memory budget",
            limit_hits.clone(),
        );
        let network_decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "network_decisions",
            "Connection attempts and name lookups of commands under a network policy, by \
             decision (allowed, denied); each is a line of the decision log",
            network_decisions.clone(),
        );
        let decision = |name: &str| {
            network_decisions
                .get_or_create(&DecisionLabels {
                    decision: name.to_string(),
                })
                .clone()
        };
        let network = crate::enforce::log::Counters {
            allowed: decision("allowed"),
            denied: decision("denied"),
        };
        let memory = MemoryGauges::default();
        registry.register_with_unit(
            "memory_budget",
            "The daemon's memory budget for what it keeps on behalf of clients (--memory-budget-mb)",
            Unit::Bytes,
            memory.budget.clone(),
        );
        registry.register_with_unit(
            "memory_kept",
            "Bytes kept on behalf of clients now: process output, queued stdin, replies kept \
             for a resume, download queues",
            Unit::Bytes,
            memory.kept.clone(),
        );
        registry.register_with_unit(
            "client_memory_kept",
            "Bytes kept on behalf of each client now",
            Unit::Bytes,
            memory.client_kept.clone(),
        );
        registry.register(
            "build",
            "Version of the executor",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        registry.register_with_unit(
            "start_time",
            "Time the daemon started, in seconds since the Unix epoch",
            Unit::Seconds,
            ConstGauge::new(started),
        );
        Self {
            registry,
            commands,
            durations,
            in_flight,
            connections_open,
            connections,
            output_bytes,
            refusals,
            errors,
            limit_hits,
            memory,
            network,
        }
    }

    /// The counters of network policy decisions (`crate::enforce::log`).
    pub fn network(&self) -> crate::enforce::log::Counters {
        self.network.clone()
    }

    /// The gauges the memory budget keeps current.
    pub fn memory(&self) -> MemoryGauges {
        self.memory.clone()
    }

    /// Show `client`'s in-flight, connection and byte series at 0 before its first
    /// connection, so that a query tells an idle client from an unknown one and `rate()` sees
    /// the first increase. (Label sets appear only once used.)
    pub fn add_client(&self, client: &str) {
        let labels = self::client(client);
        let _ = self.in_flight.get_or_create(&labels);
        let _ = self.connections.get_or_create(&labels);
        let _ = self.output_bytes.get_or_create(&labels);
    }

    /// An authenticated connection of `client` opened; it counts as open until the returned
    /// guard is dropped.
    pub fn connection_opened(&self, client: &str) -> OpenConnection {
        self.connections.get_or_create(&self::client(client)).inc();
        self.connections_open.inc();
        OpenConnection(self.connections_open.clone())
    }

    /// A command of `client` was admitted; it counts as in flight until the returned guard is
    /// given to [`Self::command_finished`] or [`Self::command_failed`] (or dropped).
    pub fn command_started(&self, client: &str) -> InFlight {
        let gauge = self.in_flight.get_or_create_owned(&self::client(client));
        gauge.inc();
        InFlight {
            client: client.to_string(),
            gauge,
        }
    }

    /// A command ended with `result` under `profile`.
    pub fn command_finished(&self, command: InFlight, profile: &str, result: &ExecResult) {
        let extra = &result.extra;
        self.count_command(&command.client, profile, extra.ended.as_str());
        self.durations
            .get_or_create(&ProfileLabels {
                profile: profile.to_string(),
            })
            .observe(extra.duration_ms / 1000.0);
        self.output_bytes
            .get_or_create(&self::client(&command.client))
            .inc_by(extra.output_bytes);
        for limit in &extra.limits_hit {
            self.limit_hit(&command.client, limit);
        }
        if extra.ended == Ending::TimedOut {
            self.limit_hit(&command.client, "timeout");
        }
        if extra.truncated {
            self.limit_hit(&command.client, "output");
        }
    }

    /// An admitted command under `profile` could not be run: it got an error with `code`.
    pub fn command_failed(&self, command: InFlight, profile: &str, code: ErrorCode) {
        self.count_command(&command.client, profile, ERROR);
        self.errors
            .get_or_create(&CodeLabels {
                client: command.client.clone(),
                code: code.as_str().to_string(),
            })
            .inc();
    }

    /// A command request of `client` was refused with `code` before anything ran.
    pub fn command_refused(&self, client: &str, code: ErrorCode) {
        self.count_command(client, "", REFUSED);
        self.refusals
            .get_or_create(&CodeLabels {
                client: client.to_string(),
                code: code.as_str().to_string(),
            })
            .inc();
    }

    /// A command of `client` ran into `limit` (`processes`, `memory`, `timeout`, `output`), or
    /// a request of `client` was refused by a quota named `limit`.
    pub fn limit_hit(&self, client: &str, limit: &str) {
        self.limit_hits
            .get_or_create(&LimitLabels {
                client: client.to_string(),
                limit: limit.to_string(),
            })
            .inc();
    }

    fn count_command(&self, client: &str, profile: &str, outcome: &str) {
        self.commands
            .get_or_create(&CommandLabels {
                client: client.to_string(),
                profile: profile.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// The exposition: every metric in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// An open connection; dropping it closes it in the metrics.
#[must_use = "the connection counts as open only while this lives"]
pub struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A command in flight; dropping it (in [`Metrics::command_finished`] or
/// [`Metrics::command_failed`], or when its task ends any other way) ends it in the metrics.
#[must_use = "the command counts as in flight only while this lives"]
pub struct InFlight {
    client: String,
    gauge: Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clients::DEFAULT_CLIENT;
    use protocol::{Isolation, ResultExtra};

    fn result(ended: Ending, duration_ms: f64, output_bytes: u64) -> ExecResult {
        ExecResult {
            id: "c".into(),
            output: String::new(),
            returncode: 0,
            exception_info: String::new(),
            extra: ResultExtra {
                ended,
                timed_out: ended == Ending::TimedOut,
                cancelled: ended == Ending::Cancelled,
                duration_ms,
                signal: None,
                output_bytes,
                truncated: false,
                elided_bytes: 0,
                killed_processes: 0,
                limits_hit: Vec::new(),
                isolation: Isolation {
                    profile: "strict".into(),
                    layers: Vec::new(),
                    missing: Vec::new(),
                    network: None,
                },
            },
        }
    }

    /// The sample lines of `text` (no comments), to compare whole lines.
    fn samples(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    fn has(text: &str, line: &str) -> bool {
        samples(text).contains(&line)
    }

    #[test]
    fn an_unused_daemon_shows_its_version_start_and_known_clients_at_zero() {
        let metrics = Metrics::new();
        metrics.add_client(DEFAULT_CLIENT);
        let text = metrics.render().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        let version = env!("CARGO_PKG_VERSION");
        for line in [
            format!("executor_build_info{{version=\"{version}\"}} 1"),
            "executor_connections_open 0".into(),
            r#"executor_connections_total{client="default"} 0"#.into(),
            r#"executor_commands_in_flight{client="default"} 0"#.into(),
            r#"executor_output_bytes_total{client="default"} 0"#.into(),
        ] {
            assert!(has(&text, &line), "missing {line}:\n{text}");
        }
        let start = samples(&text)
            .iter()
            .find_map(|l| l.strip_prefix("executor_start_time_seconds "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        // After 2020 and not in the future.
        assert!(start > 1.6e9, "{start}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        assert!(start <= now.as_secs_f64(), "{start}");
        // Command families have no sample before the first command.
        assert!(!text.contains("executor_commands_total{"), "{text}");
    }

    #[test]
    fn every_family_has_its_type_and_help_once_used() {
        let metrics = Metrics::new();
        let _connection = metrics.connection_opened(DEFAULT_CLIENT);
        let command = metrics.command_started(DEFAULT_CLIENT);
        metrics.command_finished(command, "strict", &result(Ending::Exited, 1.0, 1));
        metrics.command_refused(DEFAULT_CLIENT, ErrorCode::Busy);
        let command = metrics.command_started(DEFAULT_CLIENT);
        metrics.command_failed(command, "strict", ErrorCode::Internal);
        metrics.limit_hit(DEFAULT_CLIENT, "rate");
        let text = metrics.render().unwrap();
        for (family, kind) in [
            ("executor_commands", "counter"),
            ("executor_command_duration_seconds", "histogram"),
            ("executor_commands_in_flight", "gauge"),
            ("executor_connections_open", "gauge"),
            ("executor_connections", "counter"),
            ("executor_output_bytes", "counter"),
            ("executor_refusals", "counter"),
            ("executor_command_errors", "counter"),
            ("executor_limit_hits", "counter"),
            ("executor_build", "info"),
            ("executor_start_time_seconds", "gauge"),
        ] {
            let type_line = format!("# TYPE {family} {kind}");
            assert_eq!(
                text.lines().filter(|l| *l == type_line).count(),
                1,
                "{type_line}:\n{text}"
            );
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "{family}:\n{text}"
            );
        }
    }

    #[test]
    fn finished_commands_are_counted_by_outcome_with_duration_bytes_and_limits() {
        let metrics = Metrics::new();
        for (ended, ms, bytes) in [
            (Ending::Exited, 3.0, 10),
            (Ending::Exited, 20.0, 5),
            (Ending::TimedOut, 2000.0, 0),
        ] {
            let command = metrics.command_started(DEFAULT_CLIENT);
            metrics.command_finished(command, "strict", &result(ended, ms, bytes));
        }
        let mut cut = result(Ending::Signaled, 1.0, 9000);
        cut.extra.truncated = true;
        cut.extra.limits_hit = vec!["processes".into(), "memory".into()];
        let command = metrics.command_started("ci");
        metrics.command_finished(command, "trusted", &cut);
        let text = metrics.render().unwrap();
        for line in [
            r#"executor_commands_total{client="default",profile="strict",outcome="exited"} 2"#,
            r#"executor_commands_total{client="default",profile="strict",outcome="timed_out"} 1"#,
            r#"executor_commands_total{client="ci",profile="trusted",outcome="signaled"} 1"#,
            r#"executor_command_duration_seconds_count{profile="strict"} 3"#,
            r#"executor_command_duration_seconds_sum{profile="strict"} 2.023"#,
            r#"executor_command_duration_seconds_bucket{le="0.005",profile="strict"} 1"#,
            r#"executor_command_duration_seconds_bucket{le="0.025",profile="strict"} 2"#,
            r#"executor_command_duration_seconds_bucket{le="2.5",profile="strict"} 3"#,
            r#"executor_command_duration_seconds_bucket{le="+Inf",profile="strict"} 3"#,
            r#"executor_command_duration_seconds_count{profile="trusted"} 1"#,
            r#"executor_commands_in_flight{client="default"} 0"#,
            r#"executor_commands_in_flight{client="ci"} 0"#,
            r#"executor_output_bytes_total{client="default"} 15"#,
            r#"executor_output_bytes_total{client="ci"} 9000"#,
            r#"executor_limit_hits_total{client="default",limit="timeout"} 1"#,
            r#"executor_limit_hits_total{client="ci",limit="processes"} 1"#,
            r#"executor_limit_hits_total{client="ci",limit="memory"} 1"#,
            r#"executor_limit_hits_total{client="ci",limit="output"} 1"#,
        ] {
            assert!(has(&text, line), "missing {line}:\n{text}");
        }
        assert!(!text.contains(r#"limit="timeout"} 2"#), "{text}");
    }

    #[test]
    fn refusals_and_failures_are_counted_apart_from_results_and_have_no_duration() {
        let metrics = Metrics::new();
        metrics.command_refused(DEFAULT_CLIENT, ErrorCode::ProfileDenied);
        metrics.command_refused(DEFAULT_CLIENT, ErrorCode::BadRequest);
        metrics.command_refused(DEFAULT_CLIENT, ErrorCode::BadRequest);
        let command = metrics.command_started(DEFAULT_CLIENT);
        metrics.command_failed(command, "strict", ErrorCode::EnvironmentError);
        metrics.limit_hit(DEFAULT_CLIENT, "rate");
        let text = metrics.render().unwrap();
        for line in [
            r#"executor_commands_total{client="default",profile="",outcome="refused"} 3"#,
            r#"executor_commands_total{client="default",profile="strict",outcome="error"} 1"#,
            r#"executor_refusals_total{client="default",code="profile_denied"} 1"#,
            r#"executor_refusals_total{client="default",code="bad_request"} 2"#,
            r#"executor_command_errors_total{client="default",code="environment_error"} 1"#,
            r#"executor_commands_in_flight{client="default"} 0"#,
            r#"executor_limit_hits_total{client="default",limit="rate"} 1"#,
        ] {
            assert!(has(&text, line), "missing {line}:\n{text}");
        }
        assert!(
            !text.contains("executor_command_duration_seconds_count"),
            "{text}"
        );
    }

    #[test]
    fn guards_count_in_flight_commands_and_open_connections_until_dropped() {
        let metrics = Metrics::new();
        let first = metrics.connection_opened(DEFAULT_CLIENT);
        let second = metrics.connection_opened(DEFAULT_CLIENT);
        let a = metrics.command_started(DEFAULT_CLIENT);
        let b = metrics.command_started(DEFAULT_CLIENT);
        let text = metrics.render().unwrap();
        assert!(has(&text, "executor_connections_open 2"), "{text}");
        assert!(has(
            &text,
            r#"executor_connections_total{client="default"} 2"#
        ));
        assert!(has(
            &text,
            r#"executor_commands_in_flight{client="default"} 2"#
        ));
        // A task that ends without reporting (a panic) still leaves the gauges.
        drop(b);
        drop(second);
        metrics.command_finished(a, "strict", &result(Ending::Exited, 1.0, 0));
        let text = metrics.render().unwrap();
        assert!(has(&text, "executor_connections_open 1"), "{text}");
        assert!(has(
            &text,
            r#"executor_commands_in_flight{client="default"} 0"#
        ));
        drop(first);
        let text = metrics.render().unwrap();
        assert!(has(&text, "executor_connections_open 0"), "{text}");
        assert!(has(
            &text,
            r#"executor_connections_total{client="default"} 2"#
        ));
    }
}
