use super::*;
use crate::export::nbd::ExportOptions;
use crate::storage::{MemStorage, Storage};
use crate::Format;

fn exports() -> Exports {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(vec![0u8; 1 << 20]));
    let image = crate::open_storage_with(storage, Some(Format::RAW), "mem", true).unwrap();
    let dev: Arc<dyn crate::BlockDev> = Arc::new(image);
    Exports::new(vec![Export::new(dev, ExportOptions::new(""))]).unwrap()
}

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Feeds `input` in pieces of at most `piece` bytes (and never more than wanted), writing
/// the output away as it comes; returns the output, the outcome and the bytes not taken.
fn drive(input: &[u8], piece: usize) -> (Vec<u8>, Option<Outcome>, usize) {
    let exports = exports();
    let mut hs = Handshake::new();
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        out.extend_from_slice(hs.output());
        let n = hs.output().len();
        hs.written(n);
        let take = hs.wants().min(piece).min(input.len() - at);
        if take == 0 {
            return (out, None, input.len() - at);
        }
        match hs.feed(&exports, &input[at..at + take]) {
            Ok(None) => at += take,
            Ok(Some(o)) => {
                out.extend_from_slice(&hs.take_output());
                return (out, Some(o), input.len() - at - take);
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

fn session() -> Vec<u8> {
    let mut s = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    option(&mut s, OPT_LIST, &[]);
    option(&mut s, OPT_LIST, b"unexpected");
    option(&mut s, 0x4242, &[9; 100_000]);
    option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    let mut meta = 0u32.to_be_bytes().to_vec();
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    option(&mut s, OPT_SET_META_CONTEXT, &meta);
    option(&mut s, OPT_GO, &[0, 0, 0, 0, 0, 0]);
    s
}

#[test]
fn pieces_of_any_size_give_the_same_replies() {
    let mut input = session();
    // A request header after GO stays with the caller, whatever the piece size.
    input.extend_from_slice(&[0x25, 0x60, 0x95, 0x13]);
    let (whole, outcome, left) = drive(&input, usize::MAX);
    assert_eq!(left, 4);
    let Some(Outcome::Go(s)) = outcome else {
        panic!("no GO")
    };
    assert!(s.structured && s.base_allocation && !s.allocation_depth);
    assert_eq!(&whole[..8], &NBDMAGIC.to_be_bytes());
    for piece in [1, 2, 3, 7, 16, 17, 4096] {
        let (out, outcome, left) = drive(&input, piece);
        assert_eq!(out, whole, "piece {piece}");
        assert_eq!(left, 4);
        assert!(matches!(outcome, Some(Outcome::Go(_))));
    }
}

#[test]
fn a_client_that_reads_no_replies_is_not_read_either() {
    let exports = exports();
    let mut hs = Handshake::new();
    let mut list = Vec::new();
    option(&mut list, OPT_LIST, &[]);
    hs.feed(&exports, &FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    let mut sent = 0;
    while hs.wants() > 0 {
        for chunk in list.chunks(5) {
            assert!(hs.feed(&exports, chunk).unwrap().is_none());
        }
        sent += 1;
    }
    assert!(hs.output().len() >= MAX_PENDING_OUTPUT);
    assert!(hs.output().len() < MAX_PENDING_OUTPUT + 1024);
    assert_eq!(hs.options, sent);
    hs.written(hs.output().len());
    assert_eq!(hs.wants(), 16);
    assert!(hs.at_boundary());
}

#[test]
fn abort_and_bad_magic_end_the_negotiation() {
    let mut s = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    option(&mut s, OPT_ABORT, b"bye");
    let (out, outcome, _) = drive(&s, 3);
    assert!(matches!(outcome, Some(Outcome::Abort)));
    assert_eq!(&out[out.len() - 20..], &option_reply(OPT_ABORT, REP_ACK, 0));

    let exports = exports();
    let mut hs = Handshake::new();
    hs.feed(&exports, &[0, 0, 0, 1]).unwrap();
    let e = hs.feed(&exports, b"GET / HTTP/1.1\r\n").err();
    assert!(matches!(e, Some(ConnError::Protocol(m)) if m.contains("bad option magic")));
}
