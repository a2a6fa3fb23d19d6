//! Identifiers of the things that talk over NATS.

use std::fmt;

use rkyv::{Archive, Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize,
        )]
        #[rkyv(derive(Debug, PartialEq, Eq, Hash))]
        #[serde(transparent)]
        pub struct $name(
            /// The uuid's 128 bits.
            #[serde(with = "uuid_bits")]
            pub u128,
        );

        impl $name {
            /// A fresh random (v4) id.
            pub fn random() -> Self {
                Self(uuid::Uuid::new_v4().as_u128())
            }

            /// The id as a uuid.
            pub fn uuid(self) -> uuid::Uuid {
                uuid::Uuid::from_u128(self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.uuid().simple())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self)
            }
        }

        impl std::str::FromStr for $name {
            type Err = uuid::Error;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Ok(Self(uuid::Uuid::parse_str(s)?.as_u128()))
            }
        }
    };
}

id_type!(
    /// A worker process.
    WorkerId
);
id_type!(
    /// A coordinator process.
    CoordinatorId
);
id_type!(
    /// One generation stream (one choice of one request).
    StreamId
);

/// Ids travel in JSON as the uuid's simple (32 hex digits) form.
mod uuid_bits {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u128, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&uuid::Uuid::from_u128(*v).simple())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u128, D::Error> {
        let text = String::deserialize(d)?;
        uuid::Uuid::parse_str(&text)
            .map(|u| u.as_u128())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_text_and_json() {
        let id = StreamId::random();
        assert_eq!(id.to_string().parse::<StreamId>().expect("parse"), id);
        let json = serde_json::to_string(&id).expect("json");
        assert_eq!(json.len(), 34);
        assert_eq!(serde_json::from_str::<StreamId>(&json).expect("json"), id);
        assert!("not-a-uuid".parse::<WorkerId>().is_err());
        assert_ne!(StreamId::random(), StreamId::random());
    }
}
