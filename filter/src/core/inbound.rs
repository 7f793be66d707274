//! The request headers the filter acts on, picked out of one bulk read of the header map.
//!
//! Reading them one by one cost about fifteen host calls per request (most finding nothing),
//! ≈ 20 µs in Envoy's V8; one read of all pairs costs one. Values arrive as bytes: a header
//! value may hold any octet (RFC 9110 obs-text), and the SDK's text getters panic on one that
//! is not UTF-8, which used to take the whole VM down with the request.

/// Request headers forwarded on the prefill leg, as AIBrix does.
pub const FORWARDED: [&str; 6] = [
    "authorization",
    "external-filter",
    "routing-strategy",
    "x-session-id",
    "x-aibrix-session-key",
    "traceparent",
];

/// Envoy's own ORIGINAL_DST header: a client must never pick the upstream with it.
pub const ENVOY_DST_HEADER: &str = "x-envoy-original-dst-host";

/// The pods the retrying cluster's `override_host` load balancer tries, in order
/// (`ip:port,ip:port`; see `pd::fallback`). A client must never pick them either.
pub const DESTINATIONS_HEADER: &str = "x-pd-destinations";

/// Request headers by which a client could steer Envoy's router: retries (a decode leg, or a
/// whole generation, run again on the engine's cost) and timeouts (a stream with no bound).
/// Envoy's connection manager drops them only from requests it counts as external
/// (`use_remote_address` with `internal_address_config`), which a gateway behind another proxy,
/// or one whose clients sit on internal addresses, never sees; so the filter drops them from
/// every request. Retries are the filter's to ask for: it sets the retry headers itself when it
/// names a stand-in (`host::http::stand_in`). `x-envoy-upstream-alt-stat-name` would have the
/// router keep statistics under any name a client makes up: memory without bound.
pub const ENVOY_CONTROLS: [&str; 11] = [
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-upstream-stream-duration-ms",
    "x-envoy-upstream-alt-stat-name",
];

/// What the filter needs from the request headers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Inbound {
    pub path: Option<String>,
    pub traceparent: Option<String>,
    pub strategy: Option<String>,
    /// `routing-strategy` came more than once (the first one is [`Inbound::strategy`]).
    pub strategy_repeated: bool,
    pub profile: Option<String>,
    /// `x-aibrix-session-key`, when present (the caller checks its length).
    pub session_key: Option<String>,
    /// `user`: whose per-user limits the request counts against (`core::user_limits`).
    pub user: Option<String>,
    /// The explain header's value is exactly `1`.
    pub explain: bool,
    /// The explain header is present at all (it is stripped before the pods see it).
    pub explain_present: bool,
    /// The configured debug trap header is present.
    pub trap: bool,
    /// A client-sent destination header (the plugin's, Envoy's or [`DESTINATIONS_HEADER`]) is
    /// present and must go.
    pub dst_present: bool,
    /// Bit `i` set: the client sent [`ENVOY_CONTROLS`]`[i]`, which must go.
    pub envoy_controls: u16,
    /// [`FORWARDED`] headers present, in that order, first value of each.
    pub forwarded: Vec<(&'static str, String)>,
    /// The first forwarded header (in the client's order) whose value is not UTF-8: it
    /// cannot be put on the prefill leg (the SDK's callout takes text), so a PD request
    /// carrying it is refused.
    pub unforwardable: Option<&'static str>,
}

impl Inbound {
    /// Picks the headers out of `pairs` (names lowercase, as Envoy passes them). With a
    /// repeated header the first value counts, as with Envoy's single-value getter. Values
    /// that are not UTF-8 are read with replacement characters, so a bad routing header is
    /// refused by the same checks as any unknown value.
    pub fn read<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        dst_header: &str,
        explain_header: &str,
        trap_header: Option<&str>,
    ) -> Inbound {
        let mut inbound = Inbound::default();
        let mut seen_forwarded = [false; FORWARDED.len()];
        let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        let first = |slot: &mut Option<String>, v: &[u8]| {
            if slot.is_none() {
                *slot = Some(text(v));
            }
        };
        for (name, value) in pairs {
            match name {
                ":path" => first(&mut inbound.path, value),
                "traceparent" => first(&mut inbound.traceparent, value),
                "routing-strategy" => {
                    inbound.strategy_repeated |= inbound.strategy.is_some();
                    first(&mut inbound.strategy, value)
                }
                "config-profile" => first(&mut inbound.profile, value),
                "x-aibrix-session-key" => first(&mut inbound.session_key, value),
                "user" => first(&mut inbound.user, value),
                _ => {}
            }
            if name == dst_header || name == ENVOY_DST_HEADER || name == DESTINATIONS_HEADER {
                inbound.dst_present = true;
            }
            if name.starts_with("x-envoy-") {
                if let Some(i) = ENVOY_CONTROLS.iter().position(|c| *c == name) {
                    inbound.envoy_controls |= 1 << i;
                }
            }
            if name == explain_header {
                if !inbound.explain_present {
                    inbound.explain = value == b"1";
                }
                inbound.explain_present = true;
            }
            if trap_header == Some(name) {
                inbound.trap = true;
            }
            if let Some(i) = FORWARDED.iter().position(|f| *f == name) {
                if !std::mem::replace(&mut seen_forwarded[i], true) {
                    match std::str::from_utf8(value) {
                        Ok(v) => inbound.forwarded.push((FORWARDED[i], v.to_string())),
                        Err(_) => {
                            inbound.unforwardable.get_or_insert(FORWARDED[i]);
                        }
                    }
                }
            }
        }
        // Forwarded in the order AIBrix lists them, whatever order the client sent.
        inbound
            .forwarded
            .sort_by_key(|(name, _)| FORWARDED.iter().position(|f| f == name));
        inbound
    }

    /// The [`ENVOY_CONTROLS`] headers the client sent.
    pub fn envoy_controls(&self) -> impl Iterator<Item = &'static str> + '_ {
        ENVOY_CONTROLS
            .iter()
            .enumerate()
            .filter(|(i, _)| self.envoy_controls & (1 << i) != 0)
            .map(|(_, name)| *name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pairs: &[(&str, &[u8])]) -> Inbound {
        Inbound::read(
            pairs.iter().map(|(n, v)| (*n, *v)),
            "target-pod",
            "x-pd-explain",
            Some("x-trap"),
        )
    }

    #[test]
    fn picks_what_routing_needs_and_forwards_in_aibrix_order() {
        let h = read(&[
            (":path", b"/v1/chat/completions"),
            ("x-session-id", b"s1"),
            ("authorization", b"Bearer t"),
            ("routing-strategy", b"pd"),
            ("routing-strategy", b"random"),
            ("config-profile", b"fast"),
            ("x-aibrix-session-key", b"k"),
            ("traceparent", b"00-abc-def-01"),
            ("user", b"alice"),
            ("x-other", b"v"),
        ]);
        assert_eq!(h.user.as_deref(), Some("alice"));
        assert_eq!(h.path.as_deref(), Some("/v1/chat/completions"));
        assert_eq!(h.strategy.as_deref(), Some("pd"), "the first value counts");
        assert!(h.strategy_repeated);
        assert!(!read(&[("routing-strategy", b"pd")]).strategy_repeated);
        assert_eq!(h.profile.as_deref(), Some("fast"));
        assert_eq!(h.session_key.as_deref(), Some("k"));
        assert_eq!(h.traceparent.as_deref(), Some("00-abc-def-01"));
        let names: Vec<&str> = h.forwarded.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "authorization",
                "routing-strategy",
                "x-session-id",
                "x-aibrix-session-key",
                "traceparent"
            ]
        );
        assert!(!h.dst_present && !h.explain_present && !h.trap);
        assert_eq!(h.unforwardable, None);
    }

    #[test]
    fn flags_destination_explain_and_trap_headers() {
        let h = read(&[("target-pod", b"10.0.0.1:80"), ("x-pd-explain", b"1")]);
        assert!(h.dst_present && h.explain && h.explain_present);
        let h = read(&[(ENVOY_DST_HEADER, b"10.0.0.1:80"), ("x-pd-explain", b"yes")]);
        assert!(h.dst_present && !h.explain && h.explain_present);
        assert!(read(&[(DESTINATIONS_HEADER, b"10.0.0.1:80,10.0.0.2:80")]).dst_present);
        assert!(read(&[("x-trap", b"")]).trap);
    }

    /// Every retry and timeout control a client sends is listed once, in the list's order; other
    /// `x-envoy-*` headers are not the filter's to drop.
    #[test]
    fn lists_the_envoy_router_controls_a_client_sent() {
        let h = read(&[
            ("x-envoy-max-retries", b"9"),
            ("x-envoy-retry-on", b"5xx"),
            ("x-envoy-attempt-count", b"1"),
            ("x-envoy-upstream-rq-timeout-ms", b"0"),
            ("x-envoy-retry-on", b"reset"),
        ]);
        let sent: Vec<&str> = h.envoy_controls().collect();
        assert_eq!(
            sent,
            [
                "x-envoy-retry-on",
                "x-envoy-max-retries",
                "x-envoy-upstream-rq-timeout-ms"
            ]
        );
        assert!(!h.dst_present);
        let all: Vec<(&str, &[u8])> = ENVOY_CONTROLS.iter().map(|c| (*c, &b"1"[..])).collect();
        assert_eq!(read(&all).envoy_controls().count(), ENVOY_CONTROLS.len());
        assert_eq!(read(&[("x-other", b"1")]).envoy_controls().count(), 0);
    }

    /// A value that is not UTF-8 neither panics nor is forwarded altered.
    #[test]
    fn bytes_that_are_not_utf8() {
        let h = read(&[
            ("authorization", b"Bearer \xe9t\xe9"),
            ("routing-strategy", b"\xff"),
            ("x-session-id", b"\xfe"),
            ("x-aibrix-session-key", b"k\xff"),
            ("traceparent", b"00-a-b-01"),
        ]);
        assert_eq!(h.strategy.as_deref(), Some("\u{fffd}"));
        assert_eq!(h.session_key.as_deref(), Some("k\u{fffd}"));
        assert_eq!(h.unforwardable, Some("authorization"));
        let names: Vec<&str> = h.forwarded.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["traceparent"], "only valid text is forwarded");
    }
}
