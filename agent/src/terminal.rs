//! The local terminal for `agent shell`: raw mode (restored when the guard drops, on every
//! exit path that unwinds or returns) and the window size. rustix's termios calls are safe
//! wrappers of tcgetattr(3), tcsetattr(3) and TIOCGWINSZ, so the agent stays free of unsafe.

use std::io::IsTerminal;

use protocol::PtySize;
use rustix::termios::{tcgetattr, tcgetwinsize, tcsetattr, OptionalActions, Termios};

/// The size of a remote terminal when ours is unknown (stdin and stdout are not terminals).
pub const DEFAULT_SIZE: PtySize = PtySize { rows: 24, cols: 80 };

/// Our stdin in raw mode: keys go to the remote terminal as typed (Ctrl-C, Ctrl-D and
/// Ctrl-Z included, which the remote terminal turns into signals and end of file), and
/// nothing is echoed twice. The settings before are put back on drop.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// `None` when stdin is not a terminal (then there is nothing to change).
    pub fn enter() -> std::io::Result<Option<Self>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = tcgetattr(&stdin)?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(&stdin, OptionalActions::Now, &raw)?;
        Ok(Some(Self { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // TCSADRAIN: output already written (the remote shell's last words) is shown before
        // the line discipline changes back.
        let _ = tcsetattr(std::io::stdin(), OptionalActions::Drain, &self.saved);
    }
}

/// The window size of the terminal on stdin, else on stdout; `None` when neither is one.
pub fn size() -> Option<PtySize> {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let winsize = if stdin.is_terminal() {
        tcgetwinsize(&stdin).ok()
    } else if stdout.is_terminal() {
        tcgetwinsize(&stdout).ok()
    } else {
        None
    }?;
    pty_size(winsize.ws_row, winsize.ws_col)
}

/// A terminal that reports 0 rows or columns (a serial console, some CI runners) has no size.
fn pty_size(rows: u16, cols: u16) -> Option<PtySize> {
    (rows > 0 && cols > 0).then_some(PtySize { rows, cols })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_dimension_is_no_size() {
        assert_eq!(pty_size(0, 80), None);
        assert_eq!(pty_size(24, 0), None);
        assert_eq!(
            pty_size(50, 132),
            Some(PtySize {
                rows: 50,
                cols: 132
            })
        );
    }
}
