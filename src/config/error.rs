//! Config errors: every problem with its key path and source position, reported together.

use std::fmt;

use super::tree::Origin;

/// One problem in a config.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Key path such as `train.optim.betas[1]` (empty for the document itself).
    pub path: String,
    /// Where the offending value (or its table) was written; `None` for defaults nobody wrote.
    pub origin: Option<Origin>,
    pub message: String,
}

/// All problems of one config file (exit code 2).
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        writeln!(
            f,
            "{n} error{} in config {}:",
            if n == 1 { "" } else { "s" },
            self.file
        )?;
        for p in &self.problems {
            writeln!(f, "  {}", p.render(&self.file))?;
        }
        Ok(())
    }
}

impl Problem {
    /// `file:line:col: key.path: message`, or `--set k=v: key.path: message` for overrides.
    pub fn render(&self, file: &str) -> String {
        let at = match &self.origin {
            Some(Origin::File { line, col }) => format!("{file}:{line}:{col}"),
            Some(o @ Origin::Set(_)) => o.to_string(),
            Some(Origin::Document) => file.to_string(),
            None => format!("{file} (default value)"),
        };
        if self.path.is_empty() {
            format!("{at}: {}", self.message)
        } else {
            format!("{at}: {}: {}", self.path, self.message)
        }
    }
}
