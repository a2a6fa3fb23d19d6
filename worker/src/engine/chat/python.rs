//! Python's behaviour where chat templates lean on it and minijinja differs:
//! transformers' `tojson` (Python's `json.dumps`: `", "` and `": "` between items, or
//! one item a line with `indent`, non-ASCII kept) and `strftime_now` (today's date, as
//! Llama 3.2's template prints it).

use std::fmt::Write;

use minijinja::value::{Kwargs, Value};
use minijinja::{Error as JinjaError, ErrorKind};

/// The `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub(super) fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Python's other arguments change the output; refused rather than ignored.
    for key in ["separators", "sort_keys", "ensure_ascii"] {
        if kwargs.has(key) {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson({key}=...) is not supported"),
            ));
        }
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    dump(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Appends `v` as `json.dumps` writes it.
fn dump(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                dump(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                string(k, out);
                out.push_str(": ");
                dump(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        J::String(s) => string(s, out),
        other => out.push_str(&other.to_string()),
    }
}

/// A JSON string as Python writes it with `ensure_ascii=False`: `"`, `\` and control
/// characters escaped, everything else as it is.
fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `strftime_now(format)`: the current UTC time with `%d %m %Y %y %b %B %H %M %S %%`.
pub(super) fn strftime_now(format: String) -> Result<Value, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

/// `format` for `secs` seconds after the Unix epoch, in UTC.
pub(super) fn strftime(format: &str, secs: u64) -> Result<String, JinjaError> {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => write!(out, "{d:02}"),
            Some('m') => write!(out, "{m:02}"),
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('b') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('H') => write!(out, "{:02}", rem / 3600),
            Some('M') => write!(out, "{:02}", rem / 60 % 60),
            Some('S') => write!(out, "{:02}", rem % 60),
            Some('%') => write!(out, "%"),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
        .expect("writing to a String cannot fail");
    }
    Ok(out)
}

/// The (year, month, day) of a day count from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_as_python_does() {
        // 2026-12-02 06:07:08 UTC.
        let t = 1_796_191_628;
        assert_eq!(strftime("%d %b %Y", t).expect("formats"), "02 Dec 2026");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %B %y %%", t).expect("formats"),
            "2026-12-02 06:07:08 December 26 %"
        );
        assert_eq!(strftime("%d %b %Y", 0).expect("formats"), "01 Jan 1970");
        assert_eq!(
            strftime("%d %b %Y", 951_782_400).expect("formats"),
            "29 Feb 2000"
        );
        assert!(strftime("%j", t).is_err());
    }

    #[test]
    fn json_is_spaced_as_python_writes_it() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, "é\n"], "a": {}, "c": null}"#).expect("json");
        let mut out = String::new();
        dump(&v, None, 0, &mut out);
        assert_eq!(out, r#"{"b": [1, "é\n"], "a": {}, "c": null}"#);
        let mut out = String::new();
        dump(&v, Some(2), 0, &mut out);
        assert_eq!(
            out,
            "{\n  \"b\": [\n    1,\n    \"é\\n\"\n  ],\n  \"a\": {},\n  \"c\": null\n}"
        );
    }
}
