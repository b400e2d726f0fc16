//! Compressed clusters: garbage where the data should be, zstd frames declaring large windows.

use std::path::{Path, PathBuf};

use crate::run::{assert_fails, os, run, run_limited, Limits};
use crate::writer::{put, qcow2, write, CS, L2};

/// A compressed cluster whose data is garbage: opening works, reading fails.
fn compressed_garbage(dir: &Path) -> PathBuf {
    let mut bytes = qcow2(None);
    // Guest cluster 1: compressed, one sector at the data cluster, which holds 0x11 bytes
    // (BFINAL=1, BTYPE=00 stored block with LEN != ~NLEN: invalid).
    let descriptor = (1u64 << 62) | (5 * CS);
    put(&mut bytes, L2 + 8, &descriptor.to_be_bytes());
    write(dir, "garbage.qcow2", &bytes)
}

#[test]
fn compressed_cluster_with_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let img = compressed_garbage(dir.path());
    // Human map refuses compressed clusters like qemu-img; JSON map lists them.
    assert_fails(
        &run(dir.path(), &os(&[&"map", &img])),
        1,
        "compressed clusters",
    );
    let r = run(dir.path(), &os(&[&"map", &"--output=json", &img]));
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("out.raw");
    assert_fails(
        &run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out])),
        1,
        "decompress",
    );
}

/// qemu-img compare exits 4 when reading fails ("Error while reading offset 512 of
/// garbage.qcow2: Input/output error") and 3 only when block status fails. The reference
/// matches the first (readable) cluster so the comparison reaches the broken one.
#[test]
fn compare_read_error_exits_4_and_names_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = compressed_garbage(dir.path());
    let mut reference = vec![0u8; 32 << 10];
    reference[..CS as usize].fill(0x11);
    let good = write(dir.path(), "good.raw", &reference);
    let r = run(dir.path(), &os(&[&"compare", &"-F", &"raw", &img, &good]));
    assert_fails(&r, 4, "garbage.qcow2");
}

/// A zstd frame may declare a window of up to 128 MiB (zstd's default limit) in a few bytes;
/// a cluster is at most 2 MiB, so decoding one never needs more. Run compare with a 64 MiB
/// address-space limit: plenty for a normal image (vdisk needs under 16 MiB), fatal if the
/// decoder allocates the declared window.
fn zstd_window_image(dir: &Path, window_log: u8) -> PathBuf {
    let mut bytes = qcow2(None);
    put(&mut bytes, 72, &(1u64 << 3).to_be_bytes()); // compression type feature
    put(&mut bytes, 100, &112u32.to_be_bytes()); // header length, with the type byte
    bytes[104] = 1; // zstd
                    // Frame: magic, descriptor (no content size, not single segment), window descriptor
                    // (exponent = log - 10), one last RLE block of 512 bytes of 'A'.
    let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, (window_log - 10) << 3];
    let block = 1u32 | (1 << 1) | (512 << 3);
    frame.extend_from_slice(&block.to_le_bytes()[..3]);
    frame.push(b'A');
    put(&mut bytes, 5 * CS, &[0; 512]);
    put(&mut bytes, 5 * CS, &frame);
    // Guest cluster 0 compressed at the data cluster, one sector.
    put(&mut bytes, L2, &((1u64 << 62) | (5 * CS)).to_be_bytes());
    write(dir, &format!("zstd{window_log}.qcow2"), &bytes)
}

#[test]
fn zstd_cluster_with_a_small_window_decodes_under_a_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let img = zstd_window_image(dir.path(), 10);
    let limits = Limits {
        address_space: Some(64 << 20),
    };
    let r = run_limited(dir.path(), &os(&[&"compare", &img, &img]), limits);
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("out.raw");
    let r = run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    assert!(std::fs::read(&out).unwrap()[..512]
        .iter()
        .all(|&b| b == b'A'));
}

/// Regression: the zstd decoder allocates the window the frame declares (here 128 MiB, 134615040
/// bytes seen with strace) to decode one 512-byte cluster; under a 64 MiB limit the read
/// fails. qemu-img reads the same image fine; the fix is a window limit of the cluster size
/// (`Decoder::window_log_max(cluster_bits)`: QEMU writes each cluster as one frame with a
/// known size, so its windows never exceed the cluster).
#[test]
fn zstd_cluster_declaring_a_128_mib_window_needs_no_128_mib() {
    let dir = tempfile::tempdir().unwrap();
    let img = zstd_window_image(dir.path(), 27);
    let limits = Limits {
        address_space: Some(64 << 20),
    };
    let r = run_limited(dir.path(), &os(&[&"compare", &img, &img]), limits);
    assert_eq!(r.status, 0, "{r:?}");
}
