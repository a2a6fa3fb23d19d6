//! Secrets read from `cluster.toml` or the environment: API keys, NATS passwords and
//! tokens. A [`Secret`] never prints its value: `Debug` and `Display` show `<redacted>`,
//! so a logged configuration leaks nothing.

use serde::{Deserialize, Serialize};

/// A string that must not appear in logs.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that needs it (a comparison, a connect call).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the value is empty (an unset secret).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self::new(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints_its_value() {
        let s = Secret::new("sk-very-secret");
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(format!("{s}"), "<redacted>");
        assert_eq!(s.expose(), "sk-very-secret");
    }

    #[test]
    fn a_secret_reads_and_writes_as_a_plain_string() {
        #[derive(Deserialize)]
        struct T {
            key: Secret,
        }
        let t: T = toml::from_str("key = \"abc\"").expect("valid TOML");
        assert_eq!(t.key.expose(), "abc");
        assert_eq!(
            serde_json::to_string(&t.key).expect("a string serializes"),
            "\"abc\""
        );
    }
}
