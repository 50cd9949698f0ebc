//! Notices for people (profile skipped, reconnected, executor started): on stderr, unless a
//! batch run has taken them, since many workers writing stderr would garble its progress
//! display; it sends them to its log file instead.

use std::sync::OnceLock;

type Sink = Box<dyn Fn(&str) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();

/// Send every later notice to `sink` instead of stderr (once per process).
pub fn redirect(sink: impl Fn(&str) + Send + Sync + 'static) {
    let _ = SINK.set(Box::new(sink));
}

pub fn write(line: &str) {
    match SINK.get() {
        Some(sink) => sink(line),
        None => eprintln!("{line}"),
    }
}

/// `eprintln!` that a batch run can redirect.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::notes::write(&format!($($arg)*))
    };
}
pub(crate) use note;
