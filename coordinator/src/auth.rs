//! API keys of the HTTP API: who a request comes from, what it may do, and how many
//! streams each key holds open.
//!
//! Keys come from `[auth]` in `cluster.toml` or from the environment
//! (`BATON_API_KEYS`, `BATON_ADMIN_KEYS`). Only their SHA-256 digests are kept. A
//! presented key is hashed and compared with every configured digest in constant time
//! (`subtle`), so how long the check takes tells nothing about how close a guess came.
//! A key is named in logs and in the checkpoint store by its [`KeyId`], never by its
//! value; logs show the id's first 8 hex digits (`printf %s "$KEY" | sha256sum | cut -c1-8`
//! gives the same for a key at hand).
//!
//! With no key configured the API is open: every request is [`Identity::Anonymous`],
//! streams have no owner, anyone may reattach to any stream, and no per-key limit
//! applies (`max_streams` still bounds everything together).

use std::fmt;
use std::sync::Arc;

use baton_common::config::AuthConfig;
use baton_common::secret::Secret;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The SHA-256 digest of an API key: names a key in logs and a stream's owner in the
/// store without revealing the key. [`fmt::Display`] shows the first 8 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KeyId(pub [u8; 32]);

impl KeyId {
    /// The id of `key`.
    pub fn of(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in &self.0[..4] {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// How logs name a stream's owner: its key id, or `-` when it has none.
#[derive(Debug, Clone, Copy)]
pub struct Owner<'a>(pub Option<&'a KeyId>);

impl fmt::Display for Owner<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(id) => id.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Generate, list models, reattach to its own streams.
    Api,
    /// All that, the admin routes, and reattaching to any stream.
    Admin,
}

impl Role {
    /// The name in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Api => "api",
            Role::Admin => "admin",
        }
    }
}

/// A request whose key is one of the configured ones.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Which key.
    pub key: KeyId,
    /// What it may do.
    pub role: Role,
    /// The key's stream slots (`None`: no per-key limit).
    streams: Option<Arc<Semaphore>>,
    /// `max_streams_per_key`, for the refusal's message.
    limit: u32,
    /// Its chat messages may spell special tokens (`auth.special_token_keys`).
    pub content_specials: bool,
}

/// Who made a request.
#[derive(Debug, Clone)]
pub enum Identity {
    /// Nobody in particular: no keys are configured.
    Anonymous,
    /// The holder of a configured key.
    Key(Caller),
}

impl Identity {
    /// The owner of the streams this identity opens.
    pub fn owner(&self) -> Option<KeyId> {
        match self {
            Identity::Anonymous => None,
            Identity::Key(caller) => Some(caller.key),
        }
    }

    /// Whether its chat messages may spell the model's special tokens.
    pub fn content_specials(&self) -> bool {
        matches!(self, Identity::Key(c) if c.content_specials)
    }

    /// Which streams this identity may reattach to.
    pub fn access(&self) -> StreamAccess {
        match self {
            Identity::Anonymous => StreamAccess::Any,
            Identity::Key(Caller {
                role: Role::Admin, ..
            }) => StreamAccess::Any,
            Identity::Key(Caller {
                key,
                role: Role::Api,
                ..
            }) => StreamAccess::Owner(*key),
        }
    }

    /// Takes one of the key's stream slots, without waiting.
    pub fn admit(&self) -> Result<StreamSlot, SlotsFull> {
        let Identity::Key(caller) = self else {
            return Ok(StreamSlot { _permit: None });
        };
        let Some(streams) = &caller.streams else {
            return Ok(StreamSlot { _permit: None });
        };
        streams
            .clone()
            .try_acquire_owned()
            .map(|permit| StreamSlot {
                _permit: Some(permit),
            })
            .map_err(|_| SlotsFull {
                limit: caller.limit,
            })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Anonymous => f.write_str("-"),
            Identity::Key(caller) => caller.key.fmt(f),
        }
    }
}

/// Which streams a client may reattach to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamAccess {
    /// Any stream: the API is open, an admin key, or a NATS client (NATS has its own
    /// credentials).
    Any,
    /// Only the streams this key opened.
    Owner(KeyId),
}

impl StreamAccess {
    /// Whether a stream owned by `owner` may be read.
    pub fn allows(self, owner: Option<&KeyId>) -> bool {
        match self {
            StreamAccess::Any => true,
            StreamAccess::Owner(key) => owner == Some(&key),
        }
    }
}

/// One of a key's `max_streams_per_key` slots, held by the answer that uses it (the SSE
/// body, or the handler collecting a whole answer). Dropping it — the stream ended, or
/// its client went away and the stream was stopped — frees the slot.
#[derive(Debug)]
pub struct StreamSlot {
    /// Held, never read: dropping it gives the slot back (`None`: nothing is counted).
    _permit: Option<OwnedSemaphorePermit>,
}

/// A key holds `max_streams_per_key` open streams already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this API key holds {limit} open streams, its limit (max_streams_per_key)")]
pub struct SlotsFull {
    /// `max_streams_per_key`.
    pub limit: u32,
}

/// Why the configured keys are unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A key with no value: it would let in any request whose key is empty.
    #[error("auth.{list}[{index}] is empty; an API key needs a value")]
    Empty {
        /// `api_keys` or `admin_keys`.
        list: &'static str,
        /// Its position in the list.
        index: usize,
    },
    /// A key allowed special tokens that is not a key at all.
    #[error("auth.special_token_keys[{0}] is not one of api_keys or admin_keys")]
    StraySpecial(usize),
}

/// One configured key.
#[derive(Debug)]
struct Entry {
    id: KeyId,
    role: Role,
    /// Its stream slots, when `max_streams_per_key` is set.
    streams: Option<Arc<Semaphore>>,
    /// In `special_token_keys`.
    content_specials: bool,
}

/// Every configured key, by digest.
#[derive(Debug)]
pub struct Keys {
    /// Admin keys first; a key in both lists is an admin key.
    entries: Vec<Entry>,
    /// `max_streams_per_key` (0: none).
    limit: u32,
}

impl Keys {
    /// The keys of `config`, each with `max_streams_per_key` stream slots (0: no limit).
    pub fn new(config: &AuthConfig, max_streams_per_key: u32) -> Result<Self, KeyError> {
        let mut entries: Vec<Entry> = Vec::new();
        let lists: [(&'static str, &[Secret], Role); 2] = [
            ("admin_keys", &config.admin_keys, Role::Admin),
            ("api_keys", &config.api_keys, Role::Api),
        ];
        for (list, keys, role) in lists {
            for (index, key) in keys.iter().enumerate() {
                if key.expose().trim().is_empty() {
                    return Err(KeyError::Empty { list, index });
                }
                let id = KeyId::of(key.expose());
                if entries.iter().any(|e| e.id == id) {
                    continue;
                }
                let streams = (max_streams_per_key > 0)
                    .then(|| Arc::new(Semaphore::new(max_streams_per_key as usize)));
                entries.push(Entry {
                    id,
                    role,
                    streams,
                    content_specials: false,
                });
            }
        }
        for (index, key) in config.special_token_keys.iter().enumerate() {
            let id = KeyId::of(key.expose());
            let entry = entries.iter_mut().find(|e| e.id == id);
            entry.ok_or(KeyError::StraySpecial(index))?.content_specials = true;
        }
        Ok(Self {
            entries,
            limit: max_streams_per_key,
        })
    }

    /// Whether any key is configured: then every route but the open ones needs one.
    pub fn enabled(&self) -> bool {
        !self.entries.is_empty()
    }

    /// The configured keys' ids and roles, for the start-up log.
    pub fn ids(&self) -> impl Iterator<Item = (KeyId, Role)> + '_ {
        self.entries.iter().map(|e| (e.id, e.role))
    }

    /// The caller whose key is `presented`, if it is a configured one. Every configured
    /// digest is compared, each in constant time, whichever matches.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        let id = KeyId::of(presented);
        let mut found = Choice::from(0);
        let mut index = 0u32;
        for (i, entry) in self.entries.iter().enumerate() {
            let same = entry.id.0.ct_eq(&id.0);
            index.conditional_assign(&(i as u32), same);
            found |= same;
        }
        if !bool::from(found) {
            return None;
        }
        let entry = &self.entries[index as usize];
        Some(Caller {
            key: entry.id,
            role: entry.role,
            streams: entry.streams.clone(),
            limit: self.limit,
            content_specials: entry.content_specials,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(api: &[&str], admin: &[&str]) -> AuthConfig {
        AuthConfig {
            api_keys: api.iter().map(|k| Secret::new(*k)).collect(),
            admin_keys: admin.iter().map(|k| Secret::new(*k)).collect(),
            special_token_keys: Vec::new(),
        }
    }

    #[test]
    fn only_listed_keys_may_spell_special_tokens() {
        let mut c = config(&["sk-a", "sk-b"], &["sk-root"]);
        c.special_token_keys = vec![Secret::new("sk-b")];
        let keys = Keys::new(&c, 0).expect("keys");
        let trusted = |k: &str| keys.authenticate(k).expect("a key").content_specials;
        assert!(trusted("sk-b"));
        assert!(!trusted("sk-a") && !trusted("sk-root"));
        assert!(!Identity::Anonymous.content_specials());
        c.special_token_keys.push(Secret::new("sk-nobody"));
        assert_eq!(Keys::new(&c, 0).err(), Some(KeyError::StraySpecial(1)));
    }

    #[test]
    fn configured_keys_are_recognised_with_their_role() {
        let keys = Keys::new(&config(&["sk-a", "sk-b"], &["sk-root"]), 0).expect("keys");
        assert!(keys.enabled());
        let a = keys.authenticate("sk-b").expect("an api key");
        assert_eq!((a.key, a.role), (KeyId::of("sk-b"), Role::Api));
        let root = keys.authenticate("sk-root").expect("an admin key");
        assert_eq!(root.role, Role::Admin);
        for wrong in ["", "sk-", "sk-bb", "SK-B", " sk-b"] {
            assert!(keys.authenticate(wrong).is_none(), "{wrong:?}");
        }
        assert!(!Keys::new(&AuthConfig::default(), 4)
            .expect("none")
            .enabled());
    }

    #[test]
    fn a_key_in_both_lists_is_an_admin_key_and_empty_keys_are_refused() {
        let keys = Keys::new(&config(&["sk-x"], &["sk-x"]), 0).expect("keys");
        assert_eq!(keys.ids().count(), 1);
        assert_eq!(keys.authenticate("sk-x").expect("key").role, Role::Admin);
        assert_eq!(
            Keys::new(&config(&["sk-a", " "], &[]), 0).expect_err("empty"),
            KeyError::Empty {
                list: "api_keys",
                index: 1
            }
        );
    }

    #[test]
    fn ids_are_short_hex_and_never_the_key() {
        let id = KeyId::of("sk-very-secret");
        let shown = id.to_string();
        assert_eq!(shown.len(), 8);
        assert!(shown.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(!format!("{id:?}").contains("secret"));
        // SHA-256("abc") starts ba7816bf.
        assert_eq!(KeyId::of("abc").to_string(), "ba7816bf");
        assert_eq!(Owner(None).to_string(), "-");
    }

    #[test]
    fn api_keys_reach_their_own_streams_and_admin_keys_every_stream() {
        let keys = Keys::new(&config(&["sk-a", "sk-b"], &["sk-root"]), 0).expect("keys");
        let a = Identity::Key(keys.authenticate("sk-a").expect("a"));
        let b = Identity::Key(keys.authenticate("sk-b").expect("b"));
        let root = Identity::Key(keys.authenticate("sk-root").expect("root"));
        let owned_by_a = a.owner();
        assert!(a.access().allows(owned_by_a.as_ref()));
        assert!(!b.access().allows(owned_by_a.as_ref()));
        assert!(!b.access().allows(None));
        assert!(root.access().allows(owned_by_a.as_ref()));
        assert!(root.access().allows(None));
        assert!(Identity::Anonymous.access().allows(owned_by_a.as_ref()));
        assert_eq!(Identity::Anonymous.owner(), None);
    }

    #[test]
    fn each_key_has_its_own_stream_slots() {
        let keys = Keys::new(&config(&["sk-a", "sk-b"], &[]), 2).expect("keys");
        let a = Identity::Key(keys.authenticate("sk-a").expect("a"));
        let b = Identity::Key(keys.authenticate("sk-b").expect("b"));
        let first = a.admit().expect("one");
        let _second = a.admit().expect("two");
        assert_eq!(a.admit().expect_err("three").limit, 2);
        // Another request with the same key shares the slots; another key has its own.
        let a_again = Identity::Key(keys.authenticate("sk-a").expect("a"));
        assert!(a_again.admit().is_err());
        let _b = b.admit().expect("b has its own");
        drop(first);
        let _third = a_again.admit().expect("a slot was freed");
        // Without a limit, or without keys, nothing is counted.
        let open = Keys::new(&config(&["sk-a"], &[]), 0).expect("keys");
        let a = Identity::Key(open.authenticate("sk-a").expect("a"));
        let held: Vec<StreamSlot> = (0..100).map(|_| a.admit().expect("no limit")).collect();
        assert_eq!(held.len(), 100);
        assert!(Identity::Anonymous.admit().is_ok());
    }
}
