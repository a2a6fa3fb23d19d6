//! CORS for browser clients (`coordinator.cors_origins`): the outermost middleware, so a
//! preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered before the key
//! check sees it, as browsers send preflights without credentials. Off (no middleware,
//! no headers) when no origin is configured.

use actix_cors::Cors;

/// Why an origin in `coordinator.cors_origins` cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "coordinator.cors_origins: {0:?} is not an origin (expected \"*\" or scheme://host[:port], \
     such as \"https://app.example.com\")"
)]
pub struct BadOrigin(pub String);

/// Checks every configured origin: `*`, or `http(s)://host[:port]` with nothing after.
pub fn check(origins: &[String]) -> Result<(), BadOrigin> {
    for origin in origins {
        if origin == "*" {
            continue;
        }
        let rest = origin
            .strip_prefix("https://")
            .or_else(|| origin.strip_prefix("http://"));
        let fine = rest.is_some_and(|host| {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        });
        if !fine {
            return Err(BadOrigin(origin.clone()));
        }
    }
    Ok(())
}

/// The middleware for `origins` (checked by [`check`]): any request header (the `openai`
/// packages send their own `x-stainless-*` ones), the methods the API has, the headers a
/// client reads exposed, preflights cached for an hour.
pub fn middleware(origins: &[String]) -> Cors {
    let cors = Cors::default()
        .allowed_methods(["GET", "POST", "OPTIONS"])
        .allow_any_header()
        .expose_headers(["x-request-id", "retry-after"])
        .max_age(3600);
    if origins.iter().any(|o| o == "*") {
        cors.allow_any_origin().send_wildcard()
    } else {
        origins
            .iter()
            .fold(cors, |cors, origin| cors.allowed_origin(origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_checked_before_use() {
        let ok: Vec<String> = ["*", "https://app.example.com", "http://localhost:3000"]
            .map(String::from)
            .into();
        assert_eq!(check(&ok), Ok(()));
        for bad in [
            "app.example.com",
            "https://app.example.com/path",
            "https://",
            "ftp://x",
            "https://a b",
        ] {
            assert_eq!(
                check(&[bad.to_owned()]),
                Err(BadOrigin(bad.into())),
                "{bad}"
            );
        }
    }
}
