//! `n` choices: each choice of a request is a stream of its own, with its own worker,
//! checkpoint and failover. Their ids are the group's, counted up: choice `i` is stream
//! `group + i`, so that one id names them all (`Last-Event-ID: <group>:<p0>.<p1>…`). A
//! sampled choice draws from its own seed ([`choice_seed`]); choice 0 keeps the request's,
//! so `n: 1` and the first of `n: 3` are the same answer.

use baton_common::ids::StreamId;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::sessions::Update;

/// Most choices one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The stream of choice `choice` of the request whose first stream is `group`.
pub fn member(group: StreamId, choice: u32) -> StreamId {
    StreamId(group.0.wrapping_add(u128::from(choice)))
}

/// The seed of choice `choice` of a request seeded with `seed`: the seed itself for the
/// first, a mix of both (SplitMix64's finalizer) for the others.
pub fn choice_seed(seed: u64, choice: u32) -> u64 {
    if choice == 0 {
        return seed;
    }
    let mut z = seed ^ u64::from(choice).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The event id of a group after an event: each choice's last position (`-` for none
/// yet; a finished choice's is its token count, as its final event carries).
pub fn group_event_id(group: StreamId, positions: &[Option<u32>]) -> String {
    let list: Vec<String> = positions
        .iter()
        .map(|p| p.map_or_else(|| "-".to_string(), |p| p.to_string()))
        .collect();
    format!("{group}:{}", list.join("."))
}

/// The positions of a group event id's second part (`3.-.7`), if it is one (two or more
/// entries).
pub fn parse_positions(text: &str) -> Option<Vec<Option<u32>>> {
    let positions: Option<Vec<Option<u32>>> = text
        .split('.')
        .map(|p| match p {
            "-" => Some(None),
            p => p.parse::<u32>().ok().map(Some),
        })
        .collect();
    positions.filter(|p| (2..=MAX_CHOICES as usize).contains(&p.len()))
}

/// One choice's updates, read beside the others'.
#[derive(Debug)]
pub struct Member {
    /// Its index in `choices`.
    pub choice: u32,
    /// Its stream.
    pub stream: StreamId,
    /// Its updates.
    pub events: UnboundedReceiver<Update>,
    /// Its stream ended (finished or failed): no more updates are read.
    pub done: bool,
}

/// The next update of any choice still running, with its index in `members` (`None`
/// for the update: its channel closed); `None` when every choice is done.
pub async fn next(members: &mut [Member]) -> Option<(usize, Option<Update>)> {
    let waiting: Vec<_> = members
        .iter_mut()
        .enumerate()
        .filter(|(_, m)| !m.done)
        .map(|(i, m)| Box::pin(async move { (i, m.events.recv().await) }))
        .collect();
    if waiting.is_empty() {
        return None;
    }
    let ((i, update), _, _) = futures::future::select_all(waiting).await;
    Some((i, update))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_count_up_from_the_group_and_seeds_differ() {
        let g = StreamId(u128::MAX);
        assert_eq!(member(g, 0), g);
        assert_eq!(member(g, 1), StreamId(0), "wraps");
        assert_eq!(choice_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..16).map(|i| choice_seed(42, i)).collect();
        assert_eq!(seeds.len(), 16);
        assert_eq!(choice_seed(42, 3), choice_seed(42, 3));
    }

    #[test]
    fn group_ids_round_trip() {
        let g = StreamId(7);
        let id = group_event_id(g, &[Some(3), None, Some(12)]);
        assert_eq!(id, format!("{g}:3.-.12"));
        assert_eq!(
            parse_positions("3.-.12"),
            Some(vec![Some(3), None, Some(12)])
        );
        for bad in ["3", "", "3..4", "x.1", "-1.2"] {
            assert_eq!(parse_positions(bad), None, "{bad:?}");
        }
        let too_many = vec!["1"; MAX_CHOICES as usize + 1].join(".");
        assert_eq!(parse_positions(&too_many), None);
    }
}
