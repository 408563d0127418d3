//! Job and worker ids: one rule for every part of cohort that takes one.
//!
//! An id is 1 to [`MAX_ID_LEN`] characters of `[A-Za-z0-9._-]`, and neither `.` nor `..`.
//! The coordinator refuses any other (its keys in etcd, its metric labels and the status
//! page carry ids unescaped), the data plane's hello carries the job id, and a worker checks
//! its own ids before it contacts anyone, so a bad id is named at the start, by the process
//! that has it, with the same message everywhere.

use std::fmt;

/// Longest job or worker id, in characters (every accepted character is one byte).
pub const MAX_ID_LEN: usize = 128;

/// Why an id is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id is empty.
    #[error("{field} is empty")]
    Empty {
        /// What the id names (`job`, `worker_id`, ...).
        field: &'static str,
    },
    /// The id is longer than [`MAX_ID_LEN`].
    #[error("{field} is {len} bytes long (at most {MAX_ID_LEN} characters of [A-Za-z0-9._-])")]
    TooLong {
        /// What the id names.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The id holds a character outside `[A-Za-z0-9._-]`.
    #[error("{field} contains {found:?}; ids are 1..={MAX_ID_LEN} characters of [A-Za-z0-9._-]")]
    Character {
        /// What the id names.
        field: &'static str,
        /// The first character refused.
        found: char,
    },
    /// The id is `.` or `..` (a path component).
    #[error("{field} may not be {value:?}")]
    Dots {
        /// What the id names.
        field: &'static str,
        /// The id.
        value: &'static str,
    },
}

/// Checks `value` as an id; `field` names it in the error.
pub fn check_id(field: &'static str, value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { field });
    }
    if value.len() > MAX_ID_LEN {
        return Err(IdError::TooLong { field, len: value.len() });
    }
    if let Some(found) = value.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(IdError::Character { field, found });
    }
    match value {
        "." => Err(IdError::Dots { field, value: "." }),
        ".." => Err(IdError::Dots { field, value: ".." }),
        _ => Ok(()),
    }
}

/// A job id, checked ([`check_id`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(String);

/// A worker id, checked ([`check_id`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(String);

macro_rules! id_type {
    ($ty:ident, $field:literal) => {
        impl $ty {
            /// Checks `value` and wraps it.
            pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                check_id($field, &value)?;
                Ok(Self(value))
            }

            /// The id.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The id, unwrapped.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl TryFrom<String> for $ty {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl TryFrom<&str> for $ty {
            type Error = IdError;
            fn try_from(value: &str) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_type!(JobId, "job");
id_type!(WorkerId, "worker_id");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_the_allowed_characters_pass_and_others_are_named() {
        for ok in ["j", "job-1", "w.0_a", &"x".repeat(MAX_ID_LEN), "..."] {
            assert_eq!(check_id("job", ok), Ok(()), "{ok}");
        }
        assert_eq!(check_id("job", ""), Err(IdError::Empty { field: "job" }));
        assert_eq!(
            check_id("worker_id", &"x".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong { field: "worker_id", len: MAX_ID_LEN + 1 })
        );
        assert_eq!(check_id("job", "a b"), Err(IdError::Character { field: "job", found: ' ' }));
        assert_eq!(check_id("job", "a/b"), Err(IdError::Character { field: "job", found: '/' }));
        // Multi-byte characters are refused, not counted as several.
        assert_eq!(check_id("job", "jöb"), Err(IdError::Character { field: "job", found: 'ö' }));
        assert_eq!(check_id("job", ".."), Err(IdError::Dots { field: "job", value: ".." }));
        assert!(check_id("job", ".").unwrap_err().to_string().contains("may not be"));
    }

    #[test]
    fn the_types_check_on_construction() {
        assert_eq!(JobId::new("train-7").unwrap().as_str(), "train-7");
        assert_eq!(WorkerId::try_from("w0").unwrap().to_string(), "w0");
        let refused = WorkerId::new("w 0").unwrap_err().to_string();
        assert!(refused.starts_with("worker_id contains ' '"), "{refused}");
        assert!(JobId::try_from(String::new()).is_err());
    }
}
