//! Which pages of a data cluster hold data (the meaning of cow_bitmap, docs/pcow-format.md):
//! all of them, or those whose bit is set, the others reading through to the layer below.

use super::layout::Geometry;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pages {
    /// cow_bitmap 0: every page.
    Whole,
    /// Only these pages (bit `p % 64` of word `p / 64`); bits are only ever added.
    Partial(Box<[u64]>),
}

impl Pages {
    /// Pages `first..end` of a cluster of `total` pages: whole if that is all of them.
    pub fn range(total: u64, first: u64, end: u64) -> Pages {
        if first == 0 && end == total {
            return Pages::Whole;
        }
        let mut words = vec![0u64; total.div_ceil(64) as usize].into_boxed_slice();
        for p in first..end {
            words[(p / 64) as usize] |= 1 << (p % 64);
        }
        Pages::Partial(words)
    }

    pub fn has(&self, page: u64) -> bool {
        match self {
            Pages::Whole => true,
            Pages::Partial(w) => w
                .get((page / 64) as usize)
                .is_some_and(|w| w & (1 << (page % 64)) != 0),
        }
    }

    /// Adds pages `first..end`.
    pub fn add(&mut self, first: u64, end: u64) {
        if let Pages::Partial(w) = self {
            for p in first..end {
                w[(p / 64) as usize] |= 1 << (p % 64);
            }
        }
    }

    pub fn is_whole(&self) -> bool {
        matches!(self, Pages::Whole)
    }

    /// The entry's cow_bitmap field: the page bits of a narrow cluster, or for a wide one 0
    /// (whole) or 1 (partial, the bits in its wide bitmap).
    pub fn cow_bitmap(&self, geo: &Geometry) -> u32 {
        match self {
            Pages::Whole => 0,
            Pages::Partial(_) if geo.wide() => 1,
            Pages::Partial(w) => w[0] as u32,
        }
    }

    /// The wide bitmap's bytes (for a whole cluster, all pages).
    pub fn wide_bytes(&self, geo: &Geometry) -> Vec<u8> {
        let n = geo.bitmap_bytes() as usize;
        match self {
            Pages::Whole => vec![0xff; n],
            Pages::Partial(w) => w.iter().flat_map(|w| w.to_le_bytes()).take(n).collect(),
        }
    }

    /// The pages a narrow entry's cow_bitmap names; an error for bits past the cluster's pages.
    pub fn from_narrow(geo: &Geometry, cow_bitmap: u32) -> Result<Pages, String> {
        let pages = geo.pages();
        if pages < 32 && cow_bitmap >> pages != 0 {
            return Err(format!(
                "cow_bitmap {cow_bitmap:#x} names pages past the cluster's {pages}"
            ));
        }
        Ok(match cow_bitmap {
            0 => Pages::Whole,
            bits => Pages::Partial(vec![u64::from(bits)].into_boxed_slice()),
        })
    }

    /// The pages of a wide entry: its cow_bitmap flag and its wide bitmap.
    pub fn from_wide(cow_bitmap: u32, bitmap: &[u8]) -> Result<Pages, String> {
        match cow_bitmap {
            0 => Ok(Pages::Whole),
            1 => Ok(Pages::Partial(
                bitmap
                    .chunks(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte words")))
                    .collect(),
            )),
            v => Err(format!("cow_bitmap {v:#x} of a wide entry (0 or 1)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_pages_encode_as_the_papers_bitmap_and_wide_ones_apart() {
        let narrow = Geometry::new(64, 1, 65536).unwrap();
        let p = Pages::range(16, 3, 5);
        assert_eq!(p.cow_bitmap(&narrow), 0b11000);
        assert_eq!(Pages::from_narrow(&narrow, 0b11000), Ok(p.clone()));
        assert!(Pages::from_narrow(&narrow, 1 << 16).is_err());
        assert_eq!(Pages::range(16, 0, 16), Pages::Whole);
        let wide = Geometry::new(2048, 1, 2 << 20).unwrap();
        let mut p = Pages::range(512, 511, 512);
        p.add(0, 1);
        assert_eq!(p.cow_bitmap(&wide), 1);
        let bytes = p.wide_bytes(&wide);
        assert_eq!((bytes.len(), bytes[0], bytes[63]), (64, 1, 0x80));
        assert_eq!(Pages::from_wide(1, &bytes), Ok(p.clone()));
        assert!(p.has(0) && p.has(511) && !p.has(1));
        assert!(Pages::from_wide(2, &bytes).is_err());
    }
}
