//! A walk over a snapshot's wire bytes that decodes only the engine metrics and keeps
//! everything else as opaque bytes, so a VM can tell "same pods, new metrics" from "the fleet
//! changed" without decoding the fleet again.
//!
//! pd-control publishes a new snapshot whenever a scrape changes any pod's metrics: under
//! traffic that is every refresh period (20 times a second at 50 ms), and every VM of every
//! Envoy adopts each one. A full decode allocates a dozen strings per pod and parses each
//! pod's config annotation: ≈ 0.6 ms per adoption at 256 pods and ≈ 3 ms at 1024 in V8
//! (`make bench-v8-node`), on the worker's event loop. The walk allocates nothing per pod but
//! its metrics.

use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
use prost::Message;

use crate::proto;

/// Why a snapshot's bytes could not be walked (the full decode then reports the real error).
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("malformed snapshot: {0}")]
    Wire(#[from] prost::DecodeError),
    #[error("snapshot field {0} has the wrong wire type")]
    WireType(u32),
    #[error("snapshot length is out of bounds")]
    Length,
    #[error("model name is not UTF-8")]
    Utf8,
}

/// One model's pods' metrics, in snapshot order (routable pods or not).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMetrics {
    pub name: String,
    pub pods: Vec<Option<proto::PodMetrics>>,
}

/// What the walk keeps of a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Scan {
    pub version: u64,
    /// Every byte of the snapshot but the version, the generation time and the pods'
    /// metrics, framed so that equal topologies mean equally decoded fleets: two snapshots
    /// with equal topologies differ at most in metrics.
    pub topology: Vec<u8>,
    pub models: Vec<ModelMetrics>,
}

// Field numbers of `filter/proto/snapshot.proto`.
const SNAPSHOT_VERSION: u32 = 1;
const SNAPSHOT_GENERATED: u32 = 2;
const SNAPSHOT_MODELS: u32 = 3;
const MODEL_NAME: u32 = 1;
const MODEL_PODS: u32 = 2;
const POD_METRICS: u32 = 14;

// Record kinds of the topology: each record is `kind ‖ u32 length ‖ bytes`.
const REC_SNAPSHOT_FIELD: u8 = b'S';
const REC_MODEL: u8 = b'M';
const REC_MODEL_FIELD: u8 = b'F';
const REC_POD: u8 = b'P';

impl Scan {
    pub fn of(bytes: &[u8]) -> Result<Scan, ScanError> {
        let mut scan = Scan {
            version: 0,
            topology: Vec::with_capacity(bytes.len()),
            models: Vec::new(),
        };
        let mut buf = bytes;
        while !buf.is_empty() {
            let start = buf;
            let (tag, wire) = decode_key(&mut buf)?;
            match tag {
                SNAPSHOT_VERSION => {
                    expect(wire, WireType::Varint, tag)?;
                    scan.version = decode_varint(&mut buf)?;
                }
                SNAPSHOT_GENERATED => {
                    expect(wire, WireType::Varint, tag)?;
                    decode_varint(&mut buf)?;
                }
                SNAPSHOT_MODELS => {
                    expect(wire, WireType::LengthDelimited, tag)?;
                    let model = delimited(&mut buf)?;
                    scan.model(model)?;
                }
                _ => {
                    skip_field(wire, tag, &mut buf, DecodeContext::default())?;
                    record(&mut scan.topology, REC_SNAPSHOT_FIELD, consumed(start, buf));
                }
            }
        }
        Ok(scan)
    }

    fn model(&mut self, mut buf: &[u8]) -> Result<(), ScanError> {
        record(&mut self.topology, REC_MODEL, &[]);
        let mut metrics = ModelMetrics {
            name: String::new(),
            pods: Vec::new(),
        };
        while !buf.is_empty() {
            let start = buf;
            let (tag, wire) = decode_key(&mut buf)?;
            if tag == MODEL_PODS {
                expect(wire, WireType::LengthDelimited, tag)?;
                let pod = delimited(&mut buf)?;
                metrics.pods.push(self.pod(pod)?);
                continue;
            }
            if tag == MODEL_NAME {
                expect(wire, WireType::LengthDelimited, tag)?;
                let name = delimited(&mut buf)?;
                // The last occurrence wins, as in a full decode.
                metrics.name = std::str::from_utf8(name)
                    .map_err(|_| ScanError::Utf8)?
                    .to_owned();
            } else {
                skip_field(wire, tag, &mut buf, DecodeContext::default())?;
            }
            record(&mut self.topology, REC_MODEL_FIELD, consumed(start, buf));
        }
        self.models.push(metrics);
        Ok(())
    }

    /// The pod's metrics; every other field's bytes go to the topology as one record.
    fn pod(&mut self, mut buf: &[u8]) -> Result<Option<proto::PodMetrics>, ScanError> {
        let at = self.topology.len();
        record(&mut self.topology, REC_POD, &[]);
        let mut metrics: Option<proto::PodMetrics> = None;
        while !buf.is_empty() {
            let start = buf;
            let (tag, wire) = decode_key(&mut buf)?;
            if tag == POD_METRICS {
                expect(wire, WireType::LengthDelimited, tag)?;
                // A repeated message field merges into the earlier one, as in a full decode.
                metrics
                    .get_or_insert_with(Default::default)
                    .merge(delimited(&mut buf)?)?;
            } else {
                skip_field(wire, tag, &mut buf, DecodeContext::default())?;
                self.topology.extend_from_slice(consumed(start, buf));
            }
        }
        let len = u32::try_from(self.topology.len() - at - 5).map_err(|_| ScanError::Length)?;
        self.topology[at + 1..at + 5].copy_from_slice(&len.to_le_bytes());
        Ok(metrics)
    }
}

fn expect(got: WireType, want: WireType, tag: u32) -> Result<(), ScanError> {
    if got == want {
        Ok(())
    } else {
        Err(ScanError::WireType(tag))
    }
}

/// The payload of a length-delimited field whose key was just read.
fn delimited<'a>(buf: &mut &'a [u8]) -> Result<&'a [u8], ScanError> {
    let len = usize::try_from(decode_varint(buf)?).map_err(|_| ScanError::Length)?;
    if len > buf.len() {
        return Err(ScanError::Length);
    }
    let (payload, rest) = buf.split_at(len);
    *buf = rest;
    Ok(payload)
}

/// The bytes read from `start` to reach `now` (a suffix of it).
fn consumed<'a>(start: &'a [u8], now: &[u8]) -> &'a [u8] {
    &start[..start.len() - now.len()]
}

fn record(out: &mut Vec<u8>, kind: u8, bytes: &[u8]) {
    out.push(kind);
    // Lengths come from a snapshot that fits in memory; a record over 4 GiB cannot occur.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};

    fn scraped(mut p: proto::Pod, running: f64) -> proto::Pod {
        p.metrics = Some(proto::PodMetrics {
            present: true,
            running,
            generation_throughput: 500.0,
            last_scrape_unix_ms: 1_700_000_000_000,
            ..Default::default()
        });
        p
    }

    fn fleet() -> proto::Snapshot {
        snapshot(vec![
            scraped(pod("p0", "prefill", "g0", true), 3.0),
            scraped(pod("d0", "decode", "g0", true), 0.0),
            pod("d1", "decode", "g0", false),
        ])
    }

    #[test]
    fn metrics_come_out_in_snapshot_order_and_the_rest_is_topology() {
        let snap = fleet();
        let scan = Scan::of(&snap.encode_to_vec()).unwrap();
        assert_eq!(scan.version, 7);
        assert_eq!(scan.models.len(), 1);
        assert_eq!(scan.models[0].name, "m");
        let want: Vec<_> = snap.models[0].pods.iter().map(|p| p.metrics).collect();
        assert_eq!(scan.models[0].pods, want);
        assert!(scan.topology.windows(2).any(|w| w == b"p0"));
    }

    #[test]
    fn new_metrics_version_and_time_leave_the_topology_alone() {
        let a = fleet();
        let mut b = a.clone();
        b.version = 8;
        b.generated_unix_ms = 99;
        // Metrics that change size on the wire (a zero field is omitted), appear and vanish.
        b.models[0].pods[0].metrics.as_mut().unwrap().running = 0.0;
        b.models[0].pods[1].metrics = None;
        b.models[0].pods[2] = scraped(b.models[0].pods[2].clone(), 7.5);
        let (sa, sb) = (
            Scan::of(&a.encode_to_vec()).unwrap(),
            Scan::of(&b.encode_to_vec()).unwrap(),
        );
        assert_eq!(sa.topology, sb.topology);
        assert_eq!(sb.version, 8);
        assert_eq!(sb.models[0].pods[1], None);
        assert_eq!(sb.models[0].pods[2].map(|m| m.running), Some(7.5));
    }

    #[test]
    fn any_other_change_moves_the_topology() {
        let base = fleet();
        let topology = |s: &proto::Snapshot| Scan::of(&s.encode_to_vec()).unwrap().topology;
        type Edit = Box<dyn Fn(&mut proto::Snapshot)>;
        let edits: Vec<(&str, Edit)> = vec![
            ("ready", Box::new(|s| s.models[0].pods[2].ready = true)),
            (
                "ip",
                Box::new(|s| s.models[0].pods[0].ip = "127.0.0.9".into()),
            ),
            ("port", Box::new(|s| s.models[0].pods[0].port = 8001)),
            (
                "config",
                Box::new(|s| s.models[0].pods[1].config = "{}".into()),
            ),
            ("order", Box::new(|s| s.models[0].pods.swap(0, 1))),
            ("gone", Box::new(|s| drop(s.models[0].pods.pop()))),
            ("model", Box::new(|s| s.models[0].name = "m2".into())),
            (
                "labels",
                Box::new(|s| {
                    s.models[0].labels = Some(proto::PodLabelSets {
                        pods: vec![proto::PodLabels {
                            labels: vec![proto::Label {
                                key: "tier".into(),
                                value: "canary".into(),
                            }],
                        }],
                    })
                }),
            ),
            (
                "split",
                Box::new(|s| {
                    let last = s.models[0].pods.pop().unwrap();
                    s.models.push(proto::Model {
                        name: "m".into(),
                        pods: vec![last],
                        labels: None,
                    });
                }),
            ),
        ];
        for (what, edit) in edits {
            let mut s = base.clone();
            edit(&mut s);
            assert_ne!(topology(&s), topology(&base), "{what}");
        }
    }

    #[test]
    fn unknown_fields_are_topology_and_bad_bytes_an_error() {
        let mut bytes = fleet().encode_to_vec();
        let plain = Scan::of(&bytes).unwrap();
        // Field 15 of the snapshot, a varint: a newer pd-control's addition.
        bytes.extend_from_slice(&[15 << 3, 1]);
        let extended = Scan::of(&bytes).unwrap();
        assert_ne!(plain.topology, extended.topology);
        assert_eq!(plain.models, extended.models);
        // Every other wire type too (fixed32, fixed64, bytes, a group holding a varint), each
        // a new record, and accepted exactly when a full decode accepts it.
        let mut before = extended.topology;
        for field in [
            &[(9 << 3) | 5, 1, 2, 3, 4][..],
            &[(9 << 3) | 1, 1, 2, 3, 4, 5, 6, 7, 8][..],
            &[(9 << 3) | 2, 2, b'h', b'i'][..],
            &[(9 << 3) | 3, 0x08, 1, (9 << 3) | 4][..],
        ] {
            bytes.extend_from_slice(field);
            let scan = Scan::of(&bytes).unwrap();
            assert!(proto::Snapshot::decode(bytes.as_slice()).is_ok());
            assert_ne!(scan.topology, before, "{field:?}");
            assert_eq!(scan.models, plain.models);
            before = scan.topology;
        }
        for bad in [
            &bytes[..bytes.len() - 1],
            &[(9 << 3) | 5, 1, 2, 3][..],
            &[(9 << 3) | 1, 1, 2, 3, 4, 5, 6, 7][..],
            &[(9 << 3) | 3, 0x08, 1][..],
            &[(9 << 3) | 4][..],
            &[0x1a, 0x7f][..],
            &[0x08][..],
            &[0x1d, 0, 0, 0, 0][..],
            &[0x12, 0][..],
        ] {
            assert!(Scan::of(bad).is_err(), "{bad:?}");
            assert!(proto::Snapshot::decode(bad).is_err(), "{bad:?}");
        }
    }
}
