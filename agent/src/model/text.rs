//! Text mode: the command is the one fenced ```mswea_bash_command block of the reply, found
//! with mini-swe-agent's regex (configurable as `model.action_regex`).

use regex::Regex;

use super::Action;

pub const DEFAULT_ACTION_REGEX: &str = r"```mswea_bash_command\s*\n(.*?)\n```";

pub struct TextParser {
    regex: Regex,
}

impl TextParser {
    pub fn new(pattern: Option<&str>) -> anyhow::Result<Self> {
        let pattern = pattern.unwrap_or(DEFAULT_ACTION_REGEX);
        // Python's re.DOTALL: `.` matches newlines.
        let regex = regex::RegexBuilder::new(pattern)
            .dot_matches_new_line(true)
            .build()
            .map_err(|e| anyhow::anyhow!("model.action_regex is not a valid regex: {e}"))?;
        Ok(Self { regex })
    }

    /// Exactly one action, or the format error text and the commands found.
    pub fn parse(&self, content: &str) -> Result<Vec<Action>, (String, Vec<String>)> {
        let found: Vec<String> = self
            .regex
            .captures_iter(content)
            .filter_map(|c| c.get(1).map(|m| m.as_str().trim().to_string()))
            .collect();
        if found.len() != 1 {
            return Err((
                format!("Expected exactly 1 action, found {}.", found.len()),
                found,
            ));
        }
        Ok(found
            .into_iter()
            .map(|command| Action {
                command,
                tool_call_id: None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_fenced_block_is_one_action() {
        let parser = TextParser::new(None).unwrap();
        let actions = parser
            .parse("THOUGHT: look\n\n```mswea_bash_command\nls -la\ncat x\n```\n")
            .unwrap();
        assert_eq!(actions[0].command, "ls -la\ncat x");
    }

    #[test]
    fn zero_or_two_blocks_are_format_errors() {
        let parser = TextParser::new(None).unwrap();
        let (_, found) = parser.parse("```bash\nls\n```").unwrap_err();
        assert!(found.is_empty());
        let two = "```mswea_bash_command\na\n```\n```mswea_bash_command\nb\n```";
        let (error, found) = parser.parse(two).unwrap_err();
        assert_eq!(found, vec!["a", "b"]);
        assert!(error.contains("found 2"));
    }
}
