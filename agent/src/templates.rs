//! Jinja2 templates, rendered with minijinja the way mini-swe-agent renders them with jinja2:
//! strict undefined (a misspelt variable is an error, not an empty string), Python-style
//! slicing and `tojson`, and Python string methods through minijinja-contrib's pycompat.
//!
//! The defaults reproduce mini-swe-agent v2's shipped configs: `mini.yaml` (tool calls, the
//! default) and `mini_textbased.yaml` (a fenced ```mswea_bash_command block).

use minijinja::{Environment, UndefinedBehavior};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
#[error("cannot render the {name} template: {source:#}")]
pub struct TemplateError {
    name: &'static str,
    source: minijinja::Error,
}

/// The templates of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Templates {
    pub system_template: String,
    pub instance_template: String,
    pub observation_template: String,
    pub format_error_template: String,
}

/// Which family of defaults applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    ToolCalls,
    Text,
}

impl Templates {
    pub fn defaults(style: Style) -> Self {
        match style {
            Style::ToolCalls => Self {
                system_template: TOOLCALL_SYSTEM.into(),
                instance_template: TOOLCALL_INSTANCE.into(),
                observation_template: TOOLCALL_OBSERVATION.into(),
                format_error_template: TOOLCALL_FORMAT_ERROR.into(),
            },
            Style::Text => Self {
                system_template: TEXT_SYSTEM.into(),
                instance_template: TEXT_INSTANCE.into(),
                observation_template: TEXT_OBSERVATION.into(),
                format_error_template: TEXT_FORMAT_ERROR.into(),
            },
        }
    }
}

/// Render `template` with `context` (any serializable map).
pub fn render(
    name: &'static str,
    template: &str,
    context: &serde_json::Value,
) -> Result<String, TemplateError> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.render_str(template, context)
        .map_err(|source| TemplateError { name, source })
}

const TOOLCALL_SYSTEM: &str = "You are a helpful assistant that can interact with a computer.\n";

const TOOLCALL_INSTANCE: &str = r#"Please solve this issue: {{task}}

You can execute bash commands and edit files to implement the necessary changes.

## Recommended Workflow

This workflows should be done step-by-step so that you can iterate on your changes and any possible problems.

1. Analyze the codebase by finding and reading relevant files
2. Create a script to reproduce the issue
3. Edit the source code to resolve the issue
4. Verify your fix works by running your script again
5. Test edge cases to ensure your fix is robust
6. Submit your changes and finish your work by issuing the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.
   Do not combine it with any other command. <important>After this command, you cannot continue working on this task.</important>

## Important Rules

1. Directory or environment variable changes are not persistent. Every action is executed in a new subshell.
   However, you can prefix any action with `MY_ENV_VAR=MY_VALUE cd /path/to/working/dir && ...` or write/load environment variables from files
2. Submit your changes and finish your work by issuing the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.
   Do not combine it with any other command. <important>After this command, you cannot continue working on this task.</important>

<system_information>
{{system}} {{release}} {{version}} {{machine}}
</system_information>

## Useful command examples

### Create a new file:

```bash
cat <<'EOF' > newfile.py
import numpy as np
hello = "world"
print(hello)
EOF
```

### Edit files with sed:

{%- if system == "Darwin" -%}
<important>
You are on MacOS. For all the below examples, you need to use `sed -i ''` instead of `sed -i`.
</important>
{%- endif -%}

```bash
# Replace all occurrences
sed -i 's/old_string/new_string/g' filename.py

# Replace only first occurrence
sed -i 's/old_string/new_string/' filename.py

# Replace first occurrence on line 1
sed -i '1s/old_string/new_string/' filename.py

# Replace all occurrences in lines 1-10
sed -i '1,10s/old_string/new_string/g' filename.py
```

### View file content:

```bash
# View specific lines with numbers
nl -ba filename.py | sed -n '10,20p'
```

### Any other command you want to run

```bash
anything
```
"#;

/// mini's tool-call observation: JSON, with head 5,000 / elided count / tail 5,000 characters
/// once the output reaches 10,000 characters.
const TOOLCALL_OBSERVATION: &str = r#"{%- if output.output | length < 10000 -%}
{
  "returncode": {{ output.returncode }},
  "output": {{ output.output | tojson }}
  {%- if output.exception_info %}, "exception_info": {{ output.exception_info | tojson }}{% endif %}
}
{%- else -%}
{
  "returncode": {{ output.returncode }},
  "output_head": {{ output.output[:5000] | tojson }},
  "output_tail": {{ output.output[-5000:] | tojson }},
  "elided_chars": {{ output.output | length - 10000 }},
  "warning": "Output too long."
  {%- if output.exception_info %}, "exception_info": {{ output.exception_info | tojson }}{% endif %}
}
{%- endif -%}
"#;

const TOOLCALL_FORMAT_ERROR: &str = r#"Tool call error:

<error>
{{error}}
</error>

Here is general guidance on how to submit correct toolcalls:

Every response needs to use the 'bash' tool at least once to execute commands.

Call the bash tool with your command as the argument:
- Tool: bash
- Arguments: {"command": "your_command_here"}

If you want to end the task, please issue the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
without any other command.
"#;

const TEXT_SYSTEM: &str = r#"You are a helpful assistant that can interact with a computer.

Your response must contain exactly ONE bash code block with ONE command (or commands connected with && or ||).
Include a THOUGHT section before your command where you explain your reasoning process.
Format your response as shown in <format_example>.

<format_example>
Your reasoning and analysis here. Explain why you want to perform the action.

```mswea_bash_command
your_command_here
```
</format_example>

Failure to follow these rules will cause your response to be rejected.
"#;

const TEXT_INSTANCE: &str = r#"Please solve this issue: {{task}}

You can execute bash commands and edit files to implement the necessary changes.

## Recommended Workflow

This workflows should be done step-by-step so that you can iterate on your changes and any possible problems.

1. Analyze the codebase by finding and reading relevant files
2. Create a script to reproduce the issue
3. Edit the source code to resolve the issue
4. Verify your fix works by running your script again
5. Test edge cases to ensure your fix is robust
6. Submit your changes and finish your work by issuing the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.
   Do not combine it with any other command. <important>After this command, you cannot continue working on this task.</important>

## Important Rules

1. Every response must contain exactly one action
2. The action must be enclosed in triple backticks
3. Directory or environment variable changes are not persistent. Every action is executed in a new subshell.
   However, you can prefix any action with `MY_ENV_VAR=MY_VALUE cd /path/to/working/dir && ...` or write/load environment variables from files

<system_information>
{{system}} {{release}} {{version}} {{machine}}
</system_information>

## Formatting your response

Here is an example of a correct response:

<example_response>
THOUGHT: I need to understand the structure of the repository first. Let me check what files are in the current directory to get a better understanding of the codebase.

```mswea_bash_command
ls -la
```
</example_response>

## Useful command examples

### Create a new file:

```mswea_bash_command
cat <<'EOF' > newfile.py
import numpy as np
hello = "world"
print(hello)
EOF
```

### Edit files with sed:

{%- if system == "Darwin" -%}
<important>
You are on MacOS. For all the below examples, you need to use `sed -i ''` instead of `sed -i`.
</important>
{%- endif -%}

```mswea_bash_command
# Replace all occurrences
sed -i 's/old_string/new_string/g' filename.py

# Replace only first occurrence
sed -i 's/old_string/new_string/' filename.py

# Replace first occurrence on line 1
sed -i '1s/old_string/new_string/' filename.py

# Replace all occurrences in lines 1-10
sed -i '1,10s/old_string/new_string/g' filename.py
```

### View file content:

```mswea_bash_command
# View specific lines with numbers
nl -ba filename.py | sed -n '10,20p'
```

### Any other command you want to run

```mswea_bash_command
anything
```
"#;

const TEXT_OBSERVATION: &str = r#"{% if output.exception_info -%}
<exception>{{output.exception_info}}</exception>
{% endif -%}
<returncode>{{output.returncode}}</returncode>
{% if output.output | length < 10000 -%}
<output>
{{ output.output -}}
</output>
{%- else -%}
<warning>
The output of your last command was too long.
Please try a different command that produces less output.
If you're looking at a file you can try use head, tail or sed to view a smaller number of lines selectively.
If you're using grep or find and it produced too much output, you can use a more selective search pattern.
If you really need to see something from the full command's output, you can redirect output to a file and then search in that file.
</warning>
{%- set elided_chars = output.output | length - 10000 -%}
<output_head>
{{ output.output[:5000] }}
</output_head>
<elided_chars>
{{ elided_chars }} characters elided
</elided_chars>
<output_tail>
{{ output.output[-5000:] }}
</output_tail>
{%- endif -%}
"#;

const TEXT_FORMAT_ERROR: &str = r#"Please always provide EXACTLY ONE action in triple backticks, found {{actions|length}} actions.

Please format your action in triple backticks as shown in <response_example>.

<response_example>
Here are some thoughts about why you want to perform the action.

```mswea_bash_command
<action>
```
</response_example>

If you have completed your assignment, please consult the first message about how to
submit your solution (you will not be able to continue working on this task after that).
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn observe(style: Style, output: &str) -> String {
        let t = Templates::defaults(style);
        render(
            "observation",
            &t.observation_template,
            &json!({"output": {"output": output, "returncode": 0, "exception_info": ""}}),
        )
        .unwrap()
    }

    #[test]
    fn short_output_is_shown_whole() {
        let text = observe(Style::Text, "hello\n");
        assert_eq!(
            text,
            "<returncode>0</returncode>\n<output>\nhello\n</output>"
        );
        let json: serde_json::Value =
            serde_json::from_str(&observe(Style::ToolCalls, "a<b>\"c\"\n")).unwrap();
        assert_eq!(json["output"], "a<b>\"c\"\n");
        assert_eq!(json["returncode"], 0);
    }

    #[test]
    fn long_output_keeps_head_and_tail_of_5000_characters_and_counts_the_rest() {
        // Multi-byte characters: lengths and slices are in characters, as in Python.
        let output = format!(
            "{}{}{}",
            "é".repeat(5000),
            "x".repeat(2345),
            "ü".repeat(5000)
        );
        let json: serde_json::Value =
            serde_json::from_str(&observe(Style::ToolCalls, &output)).unwrap();
        assert_eq!(json["output_head"], "é".repeat(5000));
        assert_eq!(json["output_tail"], "ü".repeat(5000));
        assert_eq!(json["elided_chars"], 2345);
        let text = observe(Style::Text, &output);
        assert!(text.contains("<elided_chars>\n2345 characters elided\n</elided_chars>"));
        assert!(!text.contains('x'));
    }

    #[test]
    fn exactly_9999_characters_are_not_elided() {
        let json: serde_json::Value =
            serde_json::from_str(&observe(Style::ToolCalls, &"a".repeat(9999))).unwrap();
        assert_eq!(json["output"].as_str().unwrap().len(), 9999);
    }

    #[test]
    fn undefined_variables_are_errors() {
        let err = render("instance", "{{ tsak }}", &json!({"task": "x"})).unwrap_err();
        assert!(err.to_string().contains("instance"), "{err}");
    }

    #[test]
    fn instance_template_renders_with_host_facts() {
        let t = Templates::defaults(Style::ToolCalls);
        let text = render(
            "instance",
            &t.instance_template,
            &json!({"task": "Fix it", "system": "Linux", "release": "6.1", "version": "#1", "machine": "x86_64"}),
        )
        .unwrap();
        assert!(text.starts_with("Please solve this issue: Fix it\n"));
        assert!(text.contains("Linux 6.1 #1 x86_64"));
        assert!(!text.contains("MacOS"));
    }

    #[test]
    fn python_string_methods_work() {
        assert_eq!(
            render("t", "{{ x.strip() }}", &json!({"x": "  a "})).unwrap(),
            "a"
        );
    }
}
