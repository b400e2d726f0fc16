//! Compressed clusters: raw deflate (zlib type, 4 KiB window as QEMU writes it) or zstd.
//!
//! A compressed cluster's stored extent is rounded up to 512-byte sectors, so the input may
//! carry trailing bytes after the stream; decompression stops once a whole cluster is produced.

use flate2::{Compress, Compression as Level, Decompress, FlushCompress, FlushDecompress, Status};

use super::header::Compression;
use crate::error::{Error, Result};

/// Decompresses one cluster from `input` into all of `out`.
pub fn decompress(kind: Compression, input: &[u8], out: &mut [u8]) -> Result<()> {
    let ok = match kind {
        Compression::Zlib => inflate(input, out),
        Compression::Zstd => unzstd(input, out),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::corrupt(format!(
            "could not decompress a {} compressed cluster",
            kind.name()
        )))
    }
}

/// Compresses one cluster as QEMU does (raw deflate with a 4 KiB window, or one zstd frame).
/// `None` when the result would not be smaller than the cluster: it is then stored plainly.
pub fn compress(kind: Compression, input: &[u8]) -> Option<Vec<u8>> {
    let out = match kind {
        Compression::Zlib => {
            let mut c = Compress::new_with_window_bits(Level::default(), false, 12);
            let mut out = Vec::with_capacity(input.len());
            match c.compress_vec(input, &mut out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => out,
                _ => return None,
            }
        }
        Compression::Zstd => zstd::bulk::compress(input, 0).ok()?,
    };
    (out.len() < input.len()).then_some(out)
}

fn inflate(input: &[u8], out: &mut [u8]) -> bool {
    let mut d = Decompress::new(false);
    match d.decompress(input, out, FlushDecompress::Finish) {
        Ok(Status::StreamEnd) | Ok(Status::BufError) | Ok(Status::Ok) => {
            d.total_out() == out.len() as u64
        }
        Err(_) => false,
    }
}

/// Decodes zstd frames one after another straight into `out` until it is full, as QEMU's
/// streaming loop does. Single-pass decoding uses `out` itself as the history window, so a frame
/// that declares a huge window (up to 2 GiB) costs no memory beyond the cluster.
fn unzstd(input: &[u8], out: &mut [u8]) -> bool {
    use zstd::zstd_safe::{find_frame_compressed_size, DCtx};
    let mut dctx = DCtx::create();
    let (mut inp, mut outp) = (0usize, 0usize);
    while outp < out.len() {
        let Ok(frame) = find_frame_compressed_size(&input[inp..]) else {
            return false;
        };
        match dctx.decompress(&mut out[outp..], &input[inp..inp + frame]) {
            Ok(0) if frame == 0 => return false,
            Ok(n) => outp += n,
            Err(_) => return false,
        }
        inp += frame;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{Compress, Compression as Level, FlushCompress};

    #[test]
    fn raw_deflate_with_trailing_padding_decodes() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        let mut c = Compress::new(Level::default(), false);
        let mut packed = vec![0u8; 70000];
        c.compress(&data, &mut packed, FlushCompress::Finish)
            .unwrap();
        packed.truncate(c.total_out() as usize);
        packed.extend_from_slice(&[0xAA; 300]);
        let mut out = vec![0u8; 65536];
        decompress(Compression::Zlib, &packed, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn zstd_decodes_and_garbage_fails() {
        let data = vec![7u8; 4096];
        let mut packed = zstd::bulk::compress(&data, 3).unwrap();
        packed.extend_from_slice(&[0; 100]);
        let mut out = vec![0u8; 4096];
        decompress(Compression::Zstd, &packed, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(decompress(Compression::Zstd, &[1, 2, 3, 4, 5], &mut out).is_err());
        assert!(decompress(Compression::Zlib, &[0xff; 16], &mut out).is_err());
    }
}
