//! Compressed clusters: raw deflate (zlib type, 4 KiB window as QEMU writes it) or zstd.
//!
//! A compressed cluster's stored extent is rounded up to 512-byte sectors, so the input may
//! carry trailing bytes after the stream; decompression stops once a whole cluster is produced.

use flate2::{Decompress, FlushDecompress, Status};

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

fn inflate(input: &[u8], out: &mut [u8]) -> bool {
    let mut d = Decompress::new(false);
    match d.decompress(input, out, FlushDecompress::Finish) {
        Ok(Status::StreamEnd) | Ok(Status::BufError) | Ok(Status::Ok) => {
            d.total_out() == out.len() as u64
        }
        Err(_) => false,
    }
}

fn unzstd(input: &[u8], out: &mut [u8]) -> bool {
    use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
    let Ok(mut d) = Decoder::new() else {
        return false;
    };
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(out);
    while outb.pos() < outb.capacity() {
        let (in_before, out_before) = (inb.pos(), outb.pos());
        if d.run(&mut inb, &mut outb).is_err() {
            return false;
        }
        if inb.pos() == in_before && outb.pos() == out_before {
            return false;
        }
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
