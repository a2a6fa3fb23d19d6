//! How the command-line programs end: an error is one line on stderr (`error: ` and its
//! chain of causes, `: `-joined) and exit status 1, never the `Debug` form a `main` that
//! returns `Result` prints, which adds a stack backtrace whenever `RUST_BACKTRACE` is set.

use std::fmt::Display;
use std::process::ExitCode;

/// The line an error is reported as: its alternate form, which for `anyhow` errors
/// carries every cause.
pub fn error_line(e: &impl Display) -> String {
    format!("error: {e:#}")
}

/// Ends a `main`: success, or the error's one line on stderr and status 1.
pub fn report<E: Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(Inner);
    #[derive(Debug)]
    struct Inner;
    impl Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            if f.alternate() {
                write!(f, "cannot connect: {:#}", self.0)
            } else {
                f.write_str("cannot connect")
            }
        }
    }
    impl Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection refused")
        }
    }

    /// The line holds the whole chain, on one line.
    #[test]
    fn an_error_is_one_line_with_its_causes() {
        let line = error_line(&Outer(Inner));
        assert_eq!(line, "error: cannot connect: connection refused");
        assert!(!line.contains('\n'));
        assert_eq!(report::<Outer>(Ok(())), ExitCode::SUCCESS);
        assert_eq!(report(Err(Outer(Inner))), ExitCode::FAILURE);
    }
}
