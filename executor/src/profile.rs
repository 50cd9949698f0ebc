//! Sandbox profiles: data files in `sandbox-profiles/`, compiled into the binary.
//!
//! A profile says what a command may see and which defaults its environment starts from. Unknown
//! fields are errors so that a typo in a profile never silently weakens it.

use std::collections::BTreeMap;

use serde::Deserialize;

/// Profiles shipped in the binary, by file.
const BUILTIN: &[(&str, &str)] = &[(
    "trusted",
    include_str!("../../sandbox-profiles/trusted.json"),
)];

/// Name of the profile used when a request names none.
pub const DEFAULT_PROFILE: &str = "trusted";

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub description: String,
    /// Who the profile protects from whom, and what it does not cover.
    pub threat_model: String,
    /// Environment every command starts from (after the cleared one); requests override it.
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {name}: {source}")]
    Parse {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("profile file {file} declares the name {declared}")]
    NameMismatch { file: String, declared: String },
}

impl Profile {
    pub fn parse(file_name: &str, text: &str) -> Result<Self, ProfileError> {
        let profile: Profile =
            serde_json::from_str(text).map_err(|source| ProfileError::Parse {
                name: file_name.to_string(),
                source,
            })?;
        if profile.name != file_name {
            return Err(ProfileError::NameMismatch {
                file: file_name.to_string(),
                declared: profile.name,
            });
        }
        Ok(profile)
    }

    /// Every shipped profile, parsed.
    pub fn all_builtin() -> Result<Vec<Self>, ProfileError> {
        BUILTIN
            .iter()
            .map(|(file, text)| Self::parse(file, text))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn trusted() -> Profile {
        Profile::all_builtin()
            .unwrap()
            .into_iter()
            .find(|p| p.name == "trusted")
            .unwrap()
    }

    #[test]
    fn every_shipped_profile_parses() {
        let all = Profile::all_builtin().unwrap();
        assert!(all.iter().any(|p| p.name == DEFAULT_PROFILE));
        for profile in all {
            assert!(!profile.threat_model.is_empty(), "{}", profile.name);
            assert_eq!(profile.env.get("PAGER").map(String::as_str), Some("cat"));
        }
    }

    #[test]
    fn unknown_profile_field_is_an_error() {
        let err = Profile::parse(
            "x",
            r#"{"name":"x","description":"","threat_model":"","env":{},"netwrok":"host"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("netwrok"), "{err}");
    }
}
