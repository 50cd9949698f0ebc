//! The person at the terminal, for `confirm` and `human` modes: prompts on stderr, answers
//! read from stdin by one reader thread so a prompt can race Ctrl-C.

use std::io::{BufRead, IsTerminal, Write};

use tokio::sync::mpsc;

use crate::config::Mode;

pub struct Console {
    lines: mpsc::Receiver<String>,
}

/// What to do after Ctrl-C.
#[derive(Debug, PartialEq)]
pub enum Resume {
    Stop,
    /// Go on, in the (possibly switched) mode, with an optional note for the model.
    Continue(Option<String>),
}

/// What the person decided about one command in `confirm` mode.
#[derive(Debug, PartialEq)]
pub enum Decision {
    /// Run this (possibly edited) command.
    Run { command: String, edited: bool },
    /// Do not run it; the reason goes back to the model.
    Reject(String),
}

impl Console {
    /// `None` when stdin is not a terminal (batch use).
    pub fn open() -> Option<Self> {
        if !std::io::stdin().is_terminal() {
            return None;
        }
        let (tx, lines) = mpsc::channel(4);
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                let Ok(line) = line else { break };
                if tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        Some(Self { lines })
    }

    async fn ask(&mut self, prompt: &str) -> Option<String> {
        let mut err = std::io::stderr();
        let _ = write!(err, "{prompt}");
        let _ = err.flush();
        self.lines.recv().await
    }

    /// Ask about `command`; may switch `mode`. `None` when stdin closed.
    pub async fn confirm(&mut self, command: &str, mode: &mut Mode) -> Option<Decision> {
        eprintln!("\n--- command proposed by the model ---\n{command}\n-------------------------------------");
        loop {
            let answer = self
                .ask("[Enter] run | /e edit | /y run and switch to yolo | /u switch to human | other text: reject with that reason\n> ")
                .await?;
            let answer = answer.trim();
            return Some(match answer {
                "" => Decision::Run {
                    command: command.to_string(),
                    edited: false,
                },
                "/y" => {
                    *mode = Mode::Yolo;
                    eprintln!("mode: yolo (commands run without asking)");
                    Decision::Run {
                        command: command.to_string(),
                        edited: false,
                    }
                }
                "/u" => {
                    *mode = Mode::Human;
                    eprintln!("mode: human (you type the commands)");
                    Decision::Reject("The user switched to typing commands themselves.".into())
                }
                "/c" => continue,
                "/e" => {
                    let edited = self.ask("new command (one line)> ").await?;
                    if edited.trim().is_empty() {
                        continue;
                    }
                    Decision::Run {
                        command: edited,
                        edited: true,
                    }
                }
                reason => Decision::Reject(reason.to_string()),
            });
        }
    }

    /// After Ctrl-C: stop, switch mode, or add a note for the model. Stops if stdin closed.
    pub async fn after_interrupt(&mut self, mode: &mut Mode) -> Resume {
        eprintln!("\n--- interrupted ---");
        let Some(answer) = self
            .ask("[Enter] stop and save | /y yolo | /c confirm | /u human | other text: tell the model and go on\n> ")
            .await
        else {
            return Resume::Stop;
        };
        let switch = |mode: &mut Mode, to: Mode| {
            *mode = to;
            eprintln!("mode: {}", format!("{to:?}").to_lowercase());
            Resume::Continue(None)
        };
        match answer.trim() {
            "" => Resume::Stop,
            "/y" => switch(mode, Mode::Yolo),
            "/c" => switch(mode, Mode::Confirm),
            "/u" => switch(mode, Mode::Human),
            text => Resume::Continue(Some(text.to_string())),
        }
    }

    /// In `human` mode: the next command, or a mode switch (`Ok(None)`). `Err` when stdin closed.
    pub async fn human_command(&mut self, mode: &mut Mode) -> Result<Option<String>, ()> {
        loop {
            let line = self
                .ask("command (/c confirm mode, /y yolo mode)> ")
                .await
                .ok_or(())?;
            match line.trim() {
                "" => continue,
                "/c" => {
                    *mode = Mode::Confirm;
                    eprintln!("mode: confirm");
                    return Ok(None);
                }
                "/y" => {
                    *mode = Mode::Yolo;
                    eprintln!("mode: yolo");
                    return Ok(None);
                }
                _ => return Ok(Some(line)),
            }
        }
    }
}
