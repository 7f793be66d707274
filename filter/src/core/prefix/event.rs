//! The prefix event: how one worker's index update reaches the others.

/// Why a [`PrefixEvent`] could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EventError {
    #[error("prefix event is truncated")]
    Truncated,
    #[error("prefix event has unknown version {0}")]
    Version(u8),
    #[error("prefix event has a malformed length")]
    Varint,
    #[error("prefix event names are not UTF-8")]
    Utf8,
    #[error("prefix event has {0} trailing bytes")]
    Trailing(usize),
}

/// "`pod` served the prompt `stream` for `model` at `at_ms`": what a worker publishes for the
/// others after a selection, so every worker's index learns the prefix (applied with
/// [`PrefixIndex::add_prefix`](super::PrefixIndex::add_prefix)). The stream is the prompt's token stream cut to whole blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixEvent {
    pub model: String,
    pub pod: String,
    pub stream: Vec<u8>,
    pub at_ms: u64,
}

/// A [`PrefixEvent`] borrowing its parts: what a selection pushes (the request's model,
/// the pod's key, the prompt's stream) and what a reading worker applies straight from the
/// batch it read, without copying a prompt per event on either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRef<'a> {
    pub model: &'a str,
    pub pod: &'a str,
    pub stream: &'a [u8],
    pub at_ms: u64,
}

/// Wire format version, the first byte of an encoded event.
const EVENT_VERSION: u8 = 2;

impl PrefixEvent {
    pub fn as_ref(&self) -> EventRef<'_> {
        EventRef {
            model: &self.model,
            pod: &self.pod,
            stream: &self.stream,
            at_ms: self.at_ms,
        }
    }

    /// See [`EventRef::encode_into`].
    pub fn encode(&self) -> Vec<u8> {
        let e = self.as_ref();
        let mut out = Vec::with_capacity(e.encoded_len());
        e.encode_into(&mut out);
        out
    }

    /// Parses an encoded event (see [`EventRef::decode`]).
    pub fn decode(bytes: &[u8]) -> Result<PrefixEvent, EventError> {
        EventRef::decode(bytes).map(|e| e.to_owned())
    }
}

impl<'a> EventRef<'a> {
    pub fn to_owned(self) -> PrefixEvent {
        PrefixEvent {
            model: self.model.to_owned(),
            pod: self.pod.to_owned(),
            stream: self.stream.to_vec(),
            at_ms: self.at_ms,
        }
    }

    /// The exact size [`EventRef::encode_into`] writes.
    fn encoded_len(&self) -> usize {
        let field = |len: usize| varint_len(len as u64) + len;
        1 + varint_len(self.at_ms)
            + field(self.model.len())
            + field(self.pod.len())
            + field(self.stream.len())
    }

    /// `version u8 ‖ varint at_ms ‖ varint len ‖ model ‖ varint len ‖ pod ‖ varint len ‖
    /// stream`. Varints are LEB128.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(EVENT_VERSION);
        put_varint(out, self.at_ms);
        put_varint(out, self.model.len() as u64);
        out.extend_from_slice(self.model.as_bytes());
        put_varint(out, self.pod.len() as u64);
        out.extend_from_slice(self.pod.as_bytes());
        put_varint(out, self.stream.len() as u64);
        out.extend_from_slice(self.stream);
    }

    /// Parses an encoded event; any corruption is an error, never a panic or a huge allocation
    /// (lengths are checked against the remaining bytes, and nothing is copied).
    pub fn decode(bytes: &'a [u8]) -> Result<EventRef<'a>, EventError> {
        let mut r = Reader { bytes, pos: 0 };
        let version = r.take(1)?[0];
        if version != EVENT_VERSION {
            return Err(EventError::Version(version));
        }
        let at_ms = r.varint()?;
        let model = r.string()?;
        let pod = r.string()?;
        let len = r.len()?;
        let stream = r.take(len)?;
        let rest = bytes.len() - r.pos;
        if rest != 0 {
            return Err(EventError::Trailing(rest));
        }
        Ok(EventRef {
            model,
            pod,
            stream,
            at_ms,
        })
    }
}

/// Bytes a batch keeps in front of its events for the sequence number of the ring slot it is
/// published to (`log.rs`), so the batch's buffer is the slot's value as it stands: copying a
/// 256 KB prompt's batch into a new entry cost ≈ 30 µs of a worker's time in Envoy.
pub const ENTRY_HEADER: usize = 8;

/// Events waiting to go to the other workers as one batch: `varint len ‖ event` each, in
/// selection order, behind [`ENTRY_HEADER`] bytes of room. A worker publishes what it
/// gathered when a request that added to it reaches its response headers (see `host::http`),
/// one shared-data write for many selections at a high rate (`log.rs` says where batches go).
#[derive(Debug, Default)]
pub struct EventBatch {
    /// Empty, or the room for the header followed by the events.
    bytes: Vec<u8>,
    events: usize,
}

/// A batch as a ring slot holds it: [`ENTRY_HEADER`] bytes for the slot's sequence number,
/// then the events. Only [`EventBatch::take_entry`] makes one, so the room is always there.
#[derive(Debug)]
pub struct RingEntry(Vec<u8>);

impl RingEntry {
    /// The value to store for sequence number `seq`: the header filled in, the events as
    /// they are.
    pub fn stamped(&mut self, seq: u64) -> &[u8] {
        self.0[..ENTRY_HEADER].copy_from_slice(&seq.to_le_bytes());
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.len() == ENTRY_HEADER
    }

    /// Test-only: appends raw bytes after the events (a corrupt batch).
    #[cfg(test)]
    pub(crate) fn append_raw(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

impl EventBatch {
    /// Appends `event` after its length, encoded straight into the batch.
    pub fn push(&mut self, event: EventRef<'_>) {
        let len = event.encoded_len();
        let room = if self.bytes.is_empty() {
            ENTRY_HEADER
        } else {
            0
        };
        self.bytes.reserve(room + varint_len(len as u64) + len);
        self.bytes.resize(self.bytes.len() + room, 0);
        put_varint(&mut self.bytes, len as u64);
        event.encode_into(&mut self.bytes);
        self.events += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// Encoded size of the events so far.
    pub fn bytes(&self) -> usize {
        self.bytes.len().saturating_sub(ENTRY_HEADER)
    }

    /// The batch as the value of a ring slot, leaving this one empty.
    pub fn take_entry(&mut self) -> RingEntry {
        self.events = 0;
        let mut bytes = std::mem::take(&mut self.bytes);
        if bytes.is_empty() {
            bytes.resize(ENTRY_HEADER, 0);
        }
        RingEntry(bytes)
    }

    /// The batch as one message (its events only), leaving this one empty.
    pub fn take(&mut self) -> Vec<u8> {
        let mut bytes = self.take_entry().0;
        bytes.drain(..ENTRY_HEADER);
        bytes
    }

    /// The events of a message made by [`EventBatch::take`], in order, borrowed from it; the
    /// first malformed one is an error and ends the iteration (a peer's bug, not input).
    pub fn events(bytes: &[u8]) -> impl Iterator<Item = Result<EventRef<'_>, EventError>> {
        let mut r = Reader { bytes, pos: 0 };
        let mut failed = false;
        std::iter::from_fn(move || {
            if failed || r.pos >= r.bytes.len() {
                return None;
            }
            let event = r
                .len()
                .and_then(|len| r.take(len))
                .and_then(EventRef::decode);
            failed = event.is_err();
            Some(event)
        })
    }

    /// The events of a message, owned; an error for the first malformed one.
    pub fn decode(bytes: &[u8]) -> Result<Vec<PrefixEvent>, EventError> {
        EventBatch::events(bytes)
            .map(|e| e.map(EventRef::to_owned))
            .collect()
    }
}

/// Bytes of `v` as a LEB128 varint.
fn varint_len(v: u64) -> usize {
    (64 - v.leading_zeros() as usize).max(1).div_ceil(7)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EventError> {
        let end = self.pos.checked_add(n).ok_or(EventError::Truncated)?;
        let s = self.bytes.get(self.pos..end).ok_or(EventError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn varint(&mut self) -> Result<u64, EventError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(EventError::Varint);
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(EventError::Varint)
    }

    /// A length, which must fit in what is left of the input.
    fn len(&mut self) -> Result<usize, EventError> {
        let v = self.varint()?;
        let n = usize::try_from(v).map_err(|_| EventError::Truncated)?;
        if n > self.bytes.len() - self.pos {
            return Err(EventError::Truncated);
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<&'a str, EventError> {
        let n = self.len()?;
        let raw = self.take(n)?;
        std::str::from_utf8(raw).map_err(|_| EventError::Utf8)
    }
}

#[cfg(test)]
mod tests {
    use super::super::PrefixIndex;
    use super::*;

    #[test]
    fn event_round_trip() {
        let events = [
            PrefixEvent {
                model: "llama-3-8b".into(),
                pod: "default/prefill-0".into(),
                stream: b"You are a helpful assistant.".to_vec(),
                at_ms: 1_767_225_600_123,
            },
            PrefixEvent {
                model: String::new(),
                pod: "数据🚀".into(),
                stream: vec![],
                at_ms: 0,
            },
            PrefixEvent {
                model: "m".repeat(300),
                pod: "p".into(),
                stream: (0..4000u32).map(|i| i as u8).collect(),
                at_ms: u64::MAX,
            },
        ];
        for e in events {
            let bytes = e.encode();
            assert_eq!(bytes.len(), e.as_ref().encoded_len());
            assert_eq!(PrefixEvent::decode(&bytes), Ok(e.clone()));
            // Applying a decoded event is the same as adding the prefix directly.
            let mut index = PrefixIndex::new(10_000, 4);
            let back = PrefixEvent::decode(&bytes).expect("round trip");
            index.add_prefix(&back.stream, &back.model, &back.pod, back.at_ms);
            if e.stream.len() >= 4 {
                assert_eq!(
                    index.match_prefix(&e.stream, &e.model, &[&e.pod]),
                    vec![100]
                );
            }
        }
        // Compact: the stream itself plus a few bytes of names and lengths.
        let small = PrefixEvent {
            model: "m".into(),
            pod: "p".into(),
            stream: b"abcd".to_vec(),
            at_ms: 1_767_225_600_123,
        };
        assert_eq!(small.encode().len(), 1 + 6 + 2 + 2 + 1 + 4);
        for v in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(varint_len(v), out.len(), "{v}");
        }
    }

    #[test]
    fn a_batch_carries_its_events_in_order() {
        let events: Vec<PrefixEvent> = (0..5u8)
            .map(|i| PrefixEvent {
                model: format!("m{i}"),
                pod: "p".repeat(usize::from(i) * 70),
                stream: vec![i; usize::from(i) * 50],
                at_ms: u64::from(i) << 40,
            })
            .collect();
        let mut batch = EventBatch::default();
        assert!(batch.is_empty());
        assert_eq!(EventBatch::decode(&batch.take()), Ok(vec![]));
        for e in &events {
            batch.push(e.as_ref());
        }
        assert!(!batch.is_empty() && batch.bytes() > 0);
        let message = batch.take();
        assert!(batch.is_empty() && batch.bytes() == 0);
        assert_eq!(EventBatch::decode(&message), Ok(events.clone()));
        // Read borrowed, event by event; a corrupt event ends the batch after the good ones.
        let streams: Vec<&[u8]> = EventBatch::events(&message)
            .map(|e| e.expect("a good event").stream)
            .collect();
        assert_eq!(
            streams,
            events.iter().map(|e| &e.stream[..]).collect::<Vec<_>>()
        );
        let mut corrupt = message.clone();
        let (first, second) = (events[0].encode().len(), events[1].encode().len());
        // Past the first event and the second's length: the second event's version byte.
        corrupt[varint_len(first as u64) + first + varint_len(second as u64)] = 9;
        let read: Vec<_> = EventBatch::events(&corrupt).collect();
        assert_eq!(read.len(), 2, "{read:?}");
        assert_eq!(read[0], Ok(events[0].as_ref()));
        assert_eq!(read[1], Err(EventError::Version(9)));
        // A cut message is an error, or (cut between events) the events before the cut.
        for cut in 1..message.len() {
            if let Ok(got) = EventBatch::decode(&message[..cut]) {
                assert!(got.len() < events.len() && got[..] == events[..got.len()]);
            }
        }
    }

    #[test]
    fn a_ring_entry_is_the_header_then_the_message() {
        let event = PrefixEvent {
            model: "m".into(),
            pod: "ns/p".into(),
            stream: vec![7; 300],
            at_ms: 5,
        };
        let mut batch = EventBatch::default();
        assert_eq!(batch.take_entry().stamped(3), &3u64.to_le_bytes()[..]);
        for _ in 0..2 {
            batch.push(event.as_ref());
            batch.push(event.as_ref());
            let len = batch.bytes();
            let mut entry = batch.take_entry();
            assert_eq!(entry.len(), ENTRY_HEADER + len);
            let stamped = entry.stamped(u64::MAX - 1).to_vec();
            assert_eq!(stamped[..ENTRY_HEADER], (u64::MAX - 1).to_le_bytes());
            // The same events as the message `take` gives, and the batch starts afresh.
            batch.push(event.as_ref());
            batch.push(event.as_ref());
            assert_eq!(batch.bytes(), len);
            assert_eq!(stamped[ENTRY_HEADER..], batch.take()[..]);
            assert_eq!(
                EventBatch::decode(&stamped[ENTRY_HEADER..]),
                Ok(vec![event.clone(), event.clone()])
            );
        }
    }

    #[test]
    fn corrupt_events_are_errors() {
        let good = PrefixEvent {
            model: "m".into(),
            pod: "pod".into(),
            stream: vec![1, 2],
            at_ms: 300,
        }
        .encode();
        // Every truncation fails cleanly.
        for cut in 0..good.len() {
            assert_eq!(
                PrefixEvent::decode(&good[..cut]),
                Err(EventError::Truncated),
                "cut at {cut}"
            );
        }
        let mut trailing = good.clone();
        trailing.push(0);
        let mut version = good.clone();
        version[0] = 9;
        let cases: Vec<(Vec<u8>, EventError)> = vec![
            (trailing, EventError::Trailing(1)),
            (version, EventError::Version(9)),
            // The hashed format of earlier builds is refused, not misread.
            (vec![1, 0, 0, 0, 0], EventError::Version(1)),
            // Model length 1, then an invalid UTF-8 byte.
            (vec![2, 0, 1, 0xff, 0, 0], EventError::Utf8),
            // An 11-byte varint.
            (
                vec![
                    2, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
                ],
                EventError::Varint,
            ),
            // A tenth varint byte that overflows 64 bits.
            (
                vec![
                    2, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
                ],
                EventError::Varint,
            ),
            // A string length far beyond the input.
            (
                vec![2, 0, 0xff, 0xff, 0xff, 0xff, 0x0f, b'm'],
                EventError::Truncated,
            ),
            // A stream length far beyond the input: must not allocate.
            (
                vec![
                    2, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
                ],
                EventError::Truncated,
            ),
            (vec![2, 0, 0, 0, 5, 1, 2, 3], EventError::Truncated),
        ];
        for (bytes, want) in cases {
            assert_eq!(PrefixEvent::decode(&bytes), Err(want), "{bytes:?}");
        }
        // A maximal u64 varint still decodes.
        let e = PrefixEvent {
            model: String::new(),
            pod: String::new(),
            stream: vec![],
            at_ms: u64::MAX,
        };
        assert_eq!(PrefixEvent::decode(&e.encode()), Ok(e));
    }
}
