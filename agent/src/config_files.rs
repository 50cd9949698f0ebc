//! Config files by name, found where mini-swe-agent finds them
//! (`minisweagent.config.get_config_path`), so that mini's own command lines work here:
//! `-c swebench.yaml` is mini's built-in config, bundled with the agent (`agent/configs/`).

use std::path::{Path, PathBuf};

/// The mini-swe-agent release the bundled configs come from.
pub const BUNDLED_FROM: &str = "mini-swe-agent 2.4.6";

/// mini's built-in configs, by their path under its `config/` directory.
const BUNDLED: &[(&str, &str)] = &[
    ("mini.yaml", include_str!("../configs/mini.yaml")),
    ("default.yaml", include_str!("../configs/default.yaml")),
    (
        "benchmarks/swebench.yaml",
        include_str!("../configs/benchmarks/swebench.yaml"),
    ),
];

/// Where mini looks beneath its config directory for a name: there, `extra/`, `benchmarks/`.
const BUILTIN_SUBDIRS: &[&str] = &["", "extra/", "benchmarks/"];

/// A config found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    File(PathBuf),
    Bundled {
        /// Its path beneath mini's config directory (`benchmarks/swebench.yaml`).
        name: &'static str,
        text: &'static str,
    },
}

impl Found {
    /// How error messages name it.
    pub fn describe(&self) -> String {
        match self {
            Self::File(path) => path.display().to_string(),
            Self::Bundled { name, .. } => {
                format!("{name} (bundled with the agent, from {BUNDLED_FROM})")
            }
        }
    }
}

/// A config named that is nowhere; says every place looked, once each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "no config file {spec:?}: looked for {}, and among mini-swe-agent's built-in configs \
     bundled with the agent ({}, from {BUNDLED_FROM}); give a path to a YAML file, or one of \
     those names",
    tried.join(", "),
    bundled_names().join(", ")
)]
pub struct NotFound {
    pub spec: String,
    pub tried: Vec<String>,
}

fn bundled_names() -> Vec<&'static str> {
    BUNDLED
        .iter()
        .map(|(name, _)| name.rsplit('/').next().unwrap_or(name))
        .collect()
}

/// Find config `spec` as mini does: the path as given, then (with `.yaml` in place of any
/// other suffix, as mini requires) that path, the same name in `$MSWEA_CONFIG_DIR` (mini's
/// default: the current directory), and mini's built-in configs (`NAME`, `extra/NAME`,
/// `benchmarks/NAME` beneath its config directory).
pub fn find(spec: &str) -> Result<Found, NotFound> {
    find_with(
        spec,
        std::env::var_os("MSWEA_CONFIG_DIR").map(PathBuf::from),
    )
}

fn find_with(spec: &str, config_dir: Option<PathBuf>) -> Result<Found, NotFound> {
    let given = PathBuf::from(spec);
    let named = if given.extension().is_some_and(|e| e == "yaml") {
        given.clone()
    } else {
        given.with_extension("yaml")
    };
    let dir = config_dir.unwrap_or_else(|| PathBuf::from("."));
    let mut tried: Vec<PathBuf> = Vec::new();
    for candidate in [given.clone(), named.clone(), dir.join(&named)] {
        if tried.iter().any(|t| same_place(t, &candidate)) {
            continue;
        }
        if candidate.is_file() {
            return Ok(Found::File(candidate));
        }
        tried.push(candidate);
    }
    if named.is_relative() {
        let name = named.to_string_lossy();
        for sub in BUILTIN_SUBDIRS {
            let wanted = format!("{sub}{name}");
            if let Some((name, text)) = BUNDLED.iter().find(|(n, _)| *n == wanted) {
                return Ok(Found::Bundled { name, text });
            }
        }
    }
    Err(NotFound {
        spec: spec.to_string(),
        tried: tried.iter().map(|p| p.display().to_string()).collect(),
    })
}

/// `x.yaml` and `./x.yaml` are one place.
fn same_place(a: &Path, b: &Path) -> bool {
    let strip = |p: &Path| {
        p.strip_prefix(".")
            .map(Path::to_path_buf)
            .unwrap_or(p.into())
    };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mini_config_names_resolve_to_the_bundled_configs() {
        let empty = tempfile::tempdir().unwrap();
        for (spec, name) in [
            ("swebench.yaml", "benchmarks/swebench.yaml"),
            ("swebench", "benchmarks/swebench.yaml"),
            ("mini.yaml", "mini.yaml"),
            ("default", "default.yaml"),
            ("benchmarks/swebench.yaml", "benchmarks/swebench.yaml"),
        ] {
            match find_with(spec, Some(empty.path().to_path_buf())).unwrap() {
                Found::Bundled { name: found, text } => {
                    assert_eq!(found, name, "{spec}");
                    assert!(text.contains("system_template"), "{spec}");
                }
                other => panic!("{spec}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_file_wins_over_the_bundled_config_of_its_name_and_mswea_config_dir_is_searched() {
        let dir = tempfile::tempdir().unwrap();
        let mine = dir.path().join("swebench.yaml");
        std::fs::write(&mine, "agent: {step_limit: 3}\n").unwrap();
        assert_eq!(
            find_with("swebench.yaml", Some(dir.path().to_path_buf())).unwrap(),
            Found::File(dir.path().join("swebench.yaml"))
        );
        let given = mine.display().to_string();
        assert_eq!(find_with(&given, None).unwrap(), Found::File(mine.clone()));
        // A `.yml` path as given is read as it is (mini would look for `.yaml` only).
        let yml = dir.path().join("other.yml");
        std::fs::write(&yml, "{}").unwrap();
        assert_eq!(
            find_with(&yml.display().to_string(), None).unwrap(),
            Found::File(yml)
        );
    }

    #[test]
    fn a_missing_config_names_every_place_looked_once() {
        let dir = tempfile::tempdir().unwrap();
        let err = find_with("nosuch", Some(dir.path().to_path_buf())).unwrap_err();
        let text = err.to_string();
        assert_eq!(
            err.tried,
            vec![
                "nosuch".to_string(),
                "nosuch.yaml".to_string(),
                dir.path().join("nosuch.yaml").display().to_string()
            ]
        );
        assert!(
            text.contains("mini.yaml, default.yaml, swebench.yaml"),
            "{text}"
        );
        assert!(text.contains(BUNDLED_FROM), "{text}");
        assert_eq!(text.matches("nosuch.yaml").count(), 2, "{text}");
        // Without MSWEA_CONFIG_DIR, mini's default (`.`) is the path itself: said once.
        let err = find_with("nosuch.yaml", None).unwrap_err();
        assert_eq!(err.tried, vec!["nosuch.yaml".to_string()]);
    }
}
