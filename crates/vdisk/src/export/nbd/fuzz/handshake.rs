//! The handshake target: the negotiation state machine without a socket.

use std::sync::OnceLock;

use crate::export::nbd::export::Exports;
use crate::export::nbd::handshake::{Handshake, Outcome, MAX_OPTION_DATA, MAX_PENDING_OUTPUT};
use crate::export::nbd::proto::*;
use crate::rng::SplitMix64;

/// What one run produced, compared between the whole and the piecewise run.
#[derive(Debug, PartialEq, Eq)]
struct Run {
    /// Everything the server wrote, greeting first.
    output: Vec<u8>,
    /// How the negotiation ended: "go NAME structured extended base depth", "abort", "error: ...", or
    /// "open" when the input ran out first.
    end: String,
    /// Input bytes taken.
    taken: usize,
}

fn exports() -> &'static Exports {
    static EXPORTS: OnceLock<Exports> = OnceLock::new();
    // Negotiation only reads an export's name, size, flags and options: one set serves all
    // inputs.
    EXPORTS.get_or_init(|| {
        Exports::new(vec![
            super::export("", true, false),
            super::export("ro", false, true),
        ])
        .expect("two exports")
    })
}

/// Drives a negotiation with `input`, in pieces of at most `piece` bytes (never more than it
/// asks for), reading the replies away at moments `rng` picks (always when it would otherwise
/// stall).
fn drive(input: &[u8], mut rng: Option<SplitMix64>) -> Run {
    let exports = exports();
    let mut hs = Handshake::new();
    let mut output = Vec::new();
    let mut taken = 0;
    let end = loop {
        let pending = hs.output().len();
        // One option's replies can exceed the bound by at most what one option produces.
        assert!(
            pending <= MAX_PENDING_OUTPUT + 2 * MAX_OPTION_DATA as usize,
            "{pending} bytes of replies pending"
        );
        let read_now = match &mut rng {
            None => true,
            Some(r) => hs.wants() == 0 || r.below(3) == 0,
        };
        if read_now && pending > 0 {
            // A client reads what it can: sometimes only part.
            let n = match &mut rng {
                Some(r) => match r.below(2) {
                    0 => 1 + r.below(pending as u64) as usize,
                    _ => pending,
                },
                None => pending,
            };
            output.extend_from_slice(&hs.output()[..n]);
            hs.written(n);
            continue;
        }
        let want = hs.wants();
        assert!(
            want > 0,
            "a negotiation in progress with nothing pending wants input"
        );
        if taken == input.len() {
            break "open".to_string();
        }
        let piece = match &mut rng {
            None => usize::MAX,
            Some(r) => 1 + r.below(64) as usize,
        };
        let n = want.min(piece).min(input.len() - taken);
        let fed = hs.feed(exports, &input[taken..taken + n]);
        taken += n;
        match fed {
            Ok(None) => {}
            Ok(Some(Outcome::Go(s))) => {
                assert!(s.structured || !(s.base_allocation || s.allocation_depth));
                assert!(s.structured || !s.extended);
                assert!(!s.allocation_depth || s.export.options().allocation_depth);
                break format!(
                    "go '{}' {} {} {} {}",
                    s.export.name(),
                    s.structured,
                    s.extended,
                    s.base_allocation,
                    s.allocation_depth
                );
            }
            Ok(Some(Outcome::Abort)) => break "abort".to_string(),
            Err(e) => break format!("error: {e:?}"),
        }
    };
    // An ended negotiation takes nothing more; one waiting for the client wants bytes.
    assert_eq!(hs.wants() > 0, end == "open", "{end}");
    output.extend_from_slice(&hs.take_output());
    Run { output, end, taken }
}

/// Checks the server's side of a negotiation: the greeting, then option replies, each with
/// the reply magic, a known type and a consistent length (error messages as UTF-8 of at most
/// 4096 bytes); after EXPORT_NAME succeeded, its 10 or 134 bytes.
fn check_replies(run: &Run) {
    let out = &run.output;
    assert!(out.len() >= 18, "no greeting");
    assert_eq!(&out[..8], &NBDMAGIC.to_be_bytes());
    assert_eq!(&out[8..16], &IHAVEOPT.to_be_bytes());
    let mut at = 18;
    while out.len() - at >= 20 && be64(&out[at..]) == REP_MAGIC {
        let kind = be32(&out[at + 12..]);
        let len = be32(&out[at + 16..]) as usize;
        let payload = &out[at + 20..at + 20 + len];
        match kind {
            REP_ACK => assert_eq!(len, 0),
            REP_SERVER => assert!(len >= 4 && be32(payload) as usize <= len - 4),
            REP_INFO => assert!(len >= 2),
            REP_META_CONTEXT => assert!(len > 4),
            k if k & (1 << 31) != 0 => {
                assert!(len <= 4096, "error message of {len} bytes");
                assert!(
                    std::str::from_utf8(payload).is_ok(),
                    "error message not UTF-8"
                );
            }
            k => panic!("unknown reply type {k:#x}"),
        }
        at += 20 + len;
    }
    let rest = out.len() - at;
    let export_name = run.end.starts_with("go") && matches!(rest, 10 | 134);
    assert!(rest == 0 || export_name, "{rest} bytes after the replies");
}

/// The handshake target: the first byte seeds the piece sizes, the rest is the client's.
pub fn handshake(data: &[u8]) {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let whole = drive(input, None);
    check_replies(&whole);
    let pieces = drive(input, Some(SplitMix64::new(u64::from(seed) + 1)));
    assert_eq!(
        whole, pieces,
        "the pieces the input came in changed the negotiation"
    );
}
