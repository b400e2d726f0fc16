//! How names and options resolve, and QEMU's messages for those it refuses (each checked
//! against qemu-img 10.0.2 `info`; the CLI tests compare whole outputs).

use super::*;
use crate::storage::NbdServer;

fn named(name: &str) -> Result<ImageSpec> {
    ImageSpec::from_filename(name, None)
}

fn file(filename: &str) -> Protocol {
    Protocol::File {
        filename: filename.into(),
        locking: true,
    }
}

fn format_node(format: Option<Format>, file: Protocol, backing: Backing) -> Node {
    Node::Format {
        format,
        file,
        backing,
        data_file: None,
        extra: Options::default(),
    }
}

#[test]
fn plain_and_json_names_resolve_to_the_same_image() {
    let plain = named("x.qcow2").unwrap().node;
    assert_eq!(plain, format_node(None, file("x.qcow2"), Backing::Named));
    for name in [
        "file:x.qcow2",
        r#"json:{"file.filename": "x.qcow2"}"#,
        r#"json:{"file": {"driver": "file", "filename": "x.qcow2"}}"#,
        "json:{'file': {'filename': 'x.qcow2', 'aio': 'threads', 'locking': 'auto'}}",
    ] {
        assert_eq!(named(name).unwrap().node, plain, "{name}");
    }
    let opts = ImageSpec::from_image_opts("driver=qcow2,file.filename=x.qcow2", None).unwrap();
    let qcow2 = format_node(Some(Format::QCOW2), file("x.qcow2"), Backing::Named);
    assert_eq!(opts.node, qcow2);
    // -f wins over the driver a json: name gives.
    let forced = ImageSpec::from_filename(
        r#"json:{"driver": "raw", "file.filename": "x.qcow2"}"#,
        Some(Format::QCOW2),
    );
    assert_eq!(forced.unwrap().node, qcow2);
}

#[test]
fn a_file_prefix_keeps_the_rest_from_reading_as_a_protocol() {
    // QEMU names `file:a:b` ./a:b, and opens a file whose name has a colon after a slash as is.
    let node = |f| format_node(None, file(f), Backing::Named);
    assert_eq!(
        named("file:image:top.qcow2").unwrap().node,
        node("./image:top.qcow2")
    );
    assert_eq!(named("file:d/a:b.qcow2").unwrap().node, node("d/a:b.qcow2"));
    assert_eq!(named("d/a:b.qcow2").unwrap().node, node("d/a:b.qcow2"));
}

#[test]
fn backing_options_override_what_the_image_names() {
    let none = named(r#"json:{"file.filename": "x", "backing": null}"#).unwrap();
    assert_eq!(none.node, format_node(None, file("x"), Backing::None));
    let other = named(
        r#"json:{"driver": "qcow2", "file.filename": "x",
                 "backing": {"driver": "raw", "file": {"driver": "file", "filename": "b"}}}"#,
    )
    .unwrap();
    let node = Box::new(format_node(Some(Format::RAW), file("b"), Backing::Named));
    let option = "backing.driver".to_string();
    let want = format_node(
        Some(Format::QCOW2),
        file("x"),
        Backing::Node { node, option },
    );
    assert_eq!(other.node, want);
}

#[test]
fn protocols_resolve_with_their_options() {
    let null = named("null-co://").unwrap().node;
    let Node::Format { file: p, .. } = &null else {
        panic!("{null:?}")
    };
    assert_eq!(p.name(), "null-co://");
    assert!(matches!(
        p,
        Protocol::Null {
            size: NULL_DEFAULT_SIZE,
            ..
        }
    ));
    let sized = named(r#"json:{"driver": "null-co", "size": 1048576, "read-zeroes": true}"#);
    let Node::Protocol(p) = sized.unwrap().node else {
        panic!()
    };
    assert_eq!(
        p.name(),
        r#"json:{"read-zeroes": true, "driver": "null-co", "size": 1048576}"#
    );
    let nbd = named("nbd+unix:///e?socket=/s").unwrap().node;
    let target = NbdTarget {
        server: NbdServer::Unix("/s".into()),
        export: Some("e".into()),
        dirty_bitmap: None,
    };
    assert_eq!(
        nbd,
        format_node(None, Protocol::Nbd(target), Backing::Named)
    );
}

#[test]
fn a_data_file_child_is_qcow2s() {
    let s = named(r#"json:{"file.filename": "x", "data-file.filename": "d"}"#).unwrap();
    let Node::Format {
        data_file, extra, ..
    } = &s.node
    else {
        panic!()
    };
    assert_eq!(data_file, &Some(file("d")));
    assert!(check_format_options(Format::QCOW2, extra).is_ok());
    let e = check_format_options(Format::RAW, extra).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Block format 'raw' does not support the option 'data-file.filename'"
    );
}

#[test]
fn common_options_are_read_from_every_node() {
    let s = named(
        r#"json:{"file.filename": "x", "read-only": "on", "file.cache.direct": true,
                 "force-share": true, "cache": {"no-flush": true}, "detect-zeroes": "unmap"}"#,
    )
    .unwrap();
    assert!(s.read_only && s.direct && s.force_share);
}

#[test]
fn format_options_are_checked_once_the_format_is_known() {
    let s = named(r#"json:{"file.filename": "x", "lazy-refcounts": "on", "foo": 1}"#).unwrap();
    let Node::Format { extra, .. } = &s.node else {
        panic!()
    };
    let e = check_format_options(Format::QCOW2, extra).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Block format 'qcow2' does not support the option 'foo'"
    );
    let e = check_format_options(Format::RAW, extra).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Block format 'raw' does not support the option 'lazy-refcounts'"
    );
}

/// Each as qemu-img 10.0.2 says it after "Could not open 'NAME': ".
#[test]
fn refused_names_fail_with_qemus_messages() {
    let cases = [
        ("foo:x.qcow2", "Unknown protocol 'foo'"),
        (
            "null-co://x",
            "The only allowed filename for this driver is 'null-co://'",
        ),
        ("json:[1]", "Invalid JSON object given"),
        (
            "json:",
            "Could not parse the JSON options: Expecting a JSON value",
        ),
        (
            r#"json:{"a":1"#,
            "Could not parse the JSON options: JSON parse error, premature EOI",
        ),
        (
            r#"json:{"filename": "x"}"#,
            "Must specify either driver or file",
        ),
        (
            r#"json:{"driver": "qcow2", "file.filename": 1}"#,
            "Must specify either driver or file",
        ),
        (
            r#"json:{"driver": "qcow2", "filename": "x"}"#,
            "A block device must be specified for \"file\"",
        ),
        (
            r#"json:{"driver": "qcow2", "file": "x"}"#,
            "Cannot find device='x' nor node-name='x'",
        ),
        (
            r#"json:{"driver": "qcow2", "file": "x", "file.filename": "y"}"#,
            "Cannot reference an existing block device with additional options or a new filename",
        ),
        (
            r#"json:{"driver": "qcow3", "file.filename": "x"}"#,
            "Unknown driver 'qcow3'",
        ),
        (
            r#"json:{"driver": "file"}"#,
            "The 'file' block driver requires a file name",
        ),
        (
            r#"json:{"driver": "file", "filename": "x", "foo": 1}"#,
            "Block protocol 'file' doesn't support the option 'foo'",
        ),
        (
            r#"json:{"driver": "null-co", "filename": "null-co://"}"#,
            "Block protocol 'null-co' doesn't support the option 'filename'",
        ),
        (
            r#"json:{"file.filename": "x", "read-only": 1}"#,
            "Parameter 'read-only' expects 'on' or 'off'",
        ),
        (
            r#"json:{"file.filename": "x", "node-name": "x y"}"#,
            "Invalid node-name: 'x y'",
        ),
        (
            r#"json:{"file.filename": "x", "discard": "x"}"#,
            "Invalid discard option",
        ),
        (
            r#"json:{"file.filename": "x", "detect-zeroes": "x"}"#,
            "invalid parameter value: x",
        ),
        (
            r#"json:{"driver": "nbd", "host": -1, "path": "p"}"#,
            "path and host may not be used at the same time",
        ),
        ("nbd+unix:///e", "No valid URL specified"),
    ];
    for (name, want) in cases {
        assert_eq!(named(name).unwrap_err().to_string(), want, "{name}");
    }
    let e = ImageSpec::from_image_opts("", None).unwrap_err();
    assert_eq!(e.to_string(), "Must specify either driver or file");
    let e = ImageSpec::from_image_opts("x.qcow2", None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Cannot find device='x.qcow2' nor node-name='x.qcow2'"
    );
}

#[test]
fn any_text_resolves_or_fails_without_panicking() {
    let pieces = [
        "json:",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "'",
        ":",
        ",",
        "\\u",
        "\\ud800",
        "driver",
        "file.",
        "nbd://",
        "nbd+unix://",
        "?socket=",
        "null-co://",
        "=",
        ",,",
        "%",
        "%zz",
        "é",
        "0",
        "-",
        "1e",
        "true",
        "null",
    ];
    let mut rng = crate::rng::SplitMix64(0x2545_f491_4f6c_dd1d);
    for _ in 0..20_000 {
        let mut text = String::new();
        for _ in 0..rng.below(12) {
            text.push_str(pieces[rng.below(pieces.len() as u64) as usize]);
        }
        let _ = named(&text);
        let _ = ImageSpec::from_image_opts(&text, None);
    }
}
