//! ext2/3/4 metadata ranges (the kernel's Documentation/filesystems/ext4/): superblock and
//! its backups, group descriptors and reserved GDT blocks, bitmaps and inode tables where the
//! descriptors say (flex_bg moves them), and the internal journal's blocks.

use super::{Ranges, ReadFn};

pub(super) const SUPER_AT: u64 = 1024;
pub(super) const SUPER_LEN: u64 = 1024;
const MAGIC: u16 = 0xef53;

const COMPAT_HAS_JOURNAL: u32 = 0x4;
const COMPAT_SPARSE_SUPER2: u32 = 0x200;
const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
const INCOMPAT_META_BG: u32 = 0x10;
const INCOMPAT_64BIT: u32 = 0x80;
const RO_COMPAT_SPARSE_SUPER: u32 = 0x1;
const EXTENTS_FL: u32 = 0x80000;
const EXTENT_MAGIC: u16 = 0xf30a;
/// Blocks of extent tree or indirect blocks a journal may take to describe: far beyond any
/// real one (a 1 GiB journal of 4 KiB blocks needs a handful), small enough to cost little.
const MAX_MAP_BLOCKS: usize = 1024;
/// Groups a scan walks at most: 16 TiB of 4 KiB blocks has 131072.
const MAX_GROUPS: u64 = 1 << 20;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// An ext4 superblock's fields the layout needs, checked against each other and the disk.
struct Fs {
    /// Byte offset of the file system on the disk.
    base: u64,
    block: u64,
    blocks: u64,
    first_data: u64,
    per_group: u64,
    inodes_per_group: u64,
    inode_size: u64,
    groups: u64,
    desc_size: u64,
    reserved_gdt: u64,
    compat: u32,
    incompat: u32,
    ro_compat: u32,
    first_meta_bg: u64,
    backup_bgs: [u64; 2],
    journal_inum: u32,
}

impl Fs {
    fn parse(base: u64, end: u64, sb: &[u8]) -> Option<Fs> {
        if u16_at(sb, 56) != MAGIC {
            return None;
        }
        let log = u32_at(sb, 24);
        if log > 6 {
            return None;
        }
        let block = 1024u64 << log;
        let incompat = u32_at(sb, 96);
        let wide = incompat & INCOMPAT_64BIT != 0;
        let hi = if wide { u64::from(u32_at(sb, 336)) } else { 0 };
        let blocks = u64::from(u32_at(sb, 4)) | hi << 32;
        let first_data = u64::from(u32_at(sb, 20));
        let per_group = u64::from(u32_at(sb, 32));
        let inodes_per_group = u64::from(u32_at(sb, 40));
        let inode_size = if u32_at(sb, 76) == 0 {
            128
        } else {
            u64::from(u16_at(sb, 88))
        };
        let desc_size = if wide { u64::from(u16_at(sb, 254)) } else { 32 };
        // The bounds the kernel's ext4_fill_super checks, and the disk's size.
        if per_group == 0
            || per_group > block * 8
            || inodes_per_group == 0
            || inodes_per_group > block * 8
            || !(128..=block).contains(&inode_size)
            || !inode_size.is_power_of_two()
            || !(32..=1024).contains(&desc_size)
            || !desc_size.is_power_of_two()
            || first_data >= blocks
            || blocks.checked_mul(block)? > end - base
        {
            return None;
        }
        let groups = (blocks - first_data).div_ceil(per_group);
        if groups > MAX_GROUPS {
            return None;
        }
        Some(Fs {
            base,
            block,
            blocks,
            first_data,
            per_group,
            inodes_per_group,
            inode_size,
            groups,
            desc_size,
            reserved_gdt: u64::from(u16_at(sb, 206)),
            compat: u32_at(sb, 92),
            incompat,
            ro_compat: u32_at(sb, 100),
            first_meta_bg: u64::from(u32_at(sb, 260)),
            backup_bgs: [u64::from(u32_at(sb, 588)), u64::from(u32_at(sb, 592))],
            journal_inum: u32_at(sb, 224),
        })
    }

    fn group_start(&self, g: u64) -> u64 {
        self.first_data + g * self.per_group
    }

    /// Whether group `g` holds a superblock backup (ext2fs_bg_has_super).
    fn has_super(&self, g: u64) -> bool {
        if g == 0 {
            return true;
        }
        if self.compat & COMPAT_SPARSE_SUPER2 != 0 {
            return self.backup_bgs.contains(&g);
        }
        if g <= 1 || self.ro_compat & RO_COMPAT_SPARSE_SUPER == 0 {
            return true;
        }
        if g & 1 == 0 {
            return false;
        }
        [3u64, 5, 7].iter().any(|&p| {
            let mut x = p;
            while x < g {
                x *= p;
            }
            x == g
        })
    }

    fn per_block(&self) -> u64 {
        self.block / self.desc_size
    }

    fn gdt_blocks(&self) -> u64 {
        self.groups.div_ceil(self.per_block())
    }

    fn meta_bg(&self) -> bool {
        self.incompat & INCOMPAT_META_BG != 0
    }

    /// The block of the primary group descriptors' block `i` (ext2fs_descriptor_block_loc2).
    fn desc_block(&self, i: u64) -> u64 {
        if !self.meta_bg() || i < self.first_meta_bg {
            return self.first_data + 1 + i;
        }
        let g = i * self.per_block();
        self.group_start(g) + u64::from(self.has_super(g))
    }

    /// Adds `count` blocks from `block`, which must lie in the file system.
    fn add(&self, r: &mut Ranges, block: u64, count: u64) -> Option<()> {
        if block.checked_add(count)? > self.blocks {
            return None;
        }
        r.add(self.base + block * self.block, count * self.block)
            .then_some(())
    }

    fn read_block(&self, read: ReadFn, block: u64, buf: &mut [u8]) -> Option<()> {
        if block >= self.blocks {
            return None;
        }
        read(self.base + block * self.block, buf).then_some(())
    }
}

/// The metadata ranges of an ext2/3/4 file system at `[base, end)` (`None` when there is none
/// or it is malformed), and the first descriptor block a superblock found there names, whose
/// rewrite changes them.
pub(super) fn scan(base: u64, end: u64, read: ReadFn) -> (Option<Found>, Vec<(u64, u64)>) {
    let mut sb = [0u8; SUPER_LEN as usize];
    if end.saturating_sub(base) < SUPER_AT + SUPER_LEN || !read(base + SUPER_AT, &mut sb) {
        return (None, Vec::new());
    }
    let Some(fs) = Fs::parse(base, end, &sb) else {
        return (None, Vec::new());
    };
    let b = fs.desc_block(0);
    let watch = vec![(base + b * fs.block, base + (b + 1) * fs.block)];
    (ranges(&fs, read), watch)
}

/// The metadata ranges, and the bounds of the journal's blocks among them.
pub(super) type Found = (Ranges, Option<(u64, u64)>);

fn ranges(fs: &Fs, read: ReadFn) -> Option<Found> {
    let mut r = Ranges::new();
    r.add(fs.base + SUPER_AT, SUPER_LEN);

    // Superblock backups, and the descriptor copies and reserved GDT blocks after them.
    let classic = if fs.meta_bg() {
        fs.first_meta_bg.min(fs.gdt_blocks())
    } else {
        fs.gdt_blocks()
    };
    for g in (0..fs.groups).filter(|&g| fs.has_super(g)) {
        let at = if g == 0 {
            fs.first_data + 1
        } else {
            fs.add(&mut r, fs.group_start(g), 1)?;
            fs.group_start(g) + 1
        };
        fs.add(&mut r, at, classic + fs.reserved_gdt)?;
    }
    // Descriptors of meta_bg groups: in the first, second and last group of each meta group.
    for i in classic..fs.gdt_blocks() {
        let g = i * fs.per_block();
        let last = (g + fs.per_block() - 1).min(fs.groups - 1);
        for m in [g, g + 1, last].into_iter().filter(|&m| m < fs.groups) {
            fs.add(&mut r, fs.group_start(m) + u64::from(fs.has_super(m)), 1)?;
        }
    }

    // Bitmaps and inode tables, where the primary descriptors put them.
    let table_blocks = (fs.inodes_per_group * fs.inode_size).div_ceil(fs.block);
    let mut block = vec![0u8; fs.block as usize];
    for i in 0..fs.gdt_blocks() {
        let b = fs.desc_block(i);
        fs.read_block(read, b, &mut block)?;
        for (j, d) in block.chunks(fs.desc_size as usize).enumerate() {
            if i * fs.per_block() + j as u64 >= fs.groups {
                break;
            }
            let at = |lo: usize| {
                let hi = if fs.desc_size >= 64 {
                    u64::from(u32_at(d, lo + 32))
                } else {
                    0
                };
                u64::from(u32_at(d, lo)) | hi << 32
            };
            // Nothing but the superblock is in its block: a descriptor naming it is not one
            // (a table mkfs has yet to write reads as zeroes).
            if [at(0), at(4), at(8)].iter().any(|&b| b <= fs.first_data) {
                return None;
            }
            fs.add(&mut r, at(0), 1)?;
            fs.add(&mut r, at(4), 1)?;
            fs.add(&mut r, at(8), table_blocks)?;
        }
    }

    if fs.compat & COMPAT_HAS_JOURNAL != 0 && fs.incompat & INCOMPAT_JOURNAL_DEV == 0 {
        let mut j = Ranges::new();
        journal(fs, read, &mut j)?;
        let bounds = j.bounds();
        for (s, e) in j.0 {
            r.add(s, e - s).then_some(())?;
        }
        return Some((r, bounds));
    }
    Some((r, None))
}

/// Adds the blocks of the journal inode (and the blocks that map them).
fn journal(fs: &Fs, read: ReadFn, r: &mut Ranges) -> Option<()> {
    let ino = u64::from(if fs.journal_inum == 0 {
        8
    } else {
        fs.journal_inum
    });
    let (group, index) = (
        (ino - 1) / fs.inodes_per_group,
        (ino - 1) % fs.inodes_per_group,
    );
    if group >= fs.groups {
        return None;
    }
    let mut d = vec![0u8; fs.desc_size as usize];
    let at = group * fs.desc_size;
    let desc_at = fs.desc_block(at / fs.block) * fs.block + at % fs.block;
    if !read(fs.base + desc_at, &mut d) {
        return None;
    }
    let hi = if fs.desc_size >= 64 {
        u64::from(u32_at(&d, 40))
    } else {
        0
    };
    let table = u64::from(u32_at(&d, 8)) | hi << 32;
    let inode_at = table
        .checked_mul(fs.block)?
        .checked_add(index * fs.inode_size)?;
    if inode_at.checked_add(128)? > fs.blocks * fs.block {
        return None;
    }
    let mut inode = [0u8; 128];
    if !read(fs.base + inode_at, &mut inode) {
        return None;
    }
    let i_block = &inode[40..100];
    let mut budget = MAX_MAP_BLOCKS;
    if u32_at(&inode, 32) & EXTENTS_FL != 0 {
        extents(fs, read, r, i_block, 5, &mut budget)
    } else {
        for k in 0..12 {
            add_nonzero(fs, r, u64::from(u32_at(i_block, 4 * k)))?;
        }
        for (k, depth) in [(12, 1), (13, 2), (14, 3)] {
            indirect(
                fs,
                read,
                r,
                u64::from(u32_at(i_block, 4 * k)),
                depth,
                &mut budget,
            )?;
        }
        Some(())
    }
}

fn add_nonzero(fs: &Fs, r: &mut Ranges, block: u64) -> Option<()> {
    if block != 0 {
        fs.add(r, block, 1)?;
    }
    Some(())
}

/// An extent tree node (`node`: the inode's i_block or a tree block); `depth_left` bounds the
/// recursion a hostile tree could ask for.
fn extents(
    fs: &Fs,
    read: ReadFn,
    r: &mut Ranges,
    node: &[u8],
    depth_left: u32,
    budget: &mut usize,
) -> Option<()> {
    if node.len() < 12 || u16_at(node, 0) != EXTENT_MAGIC {
        return None;
    }
    let entries = usize::from(u16_at(node, 2));
    let depth = u16_at(node, 6);
    if 12 + entries * 12 > node.len() || u32::from(depth) > depth_left {
        return None;
    }
    for e in node[12..12 + entries * 12].chunks(12) {
        if depth == 0 {
            let len = u64::from(u16_at(e, 4));
            let len = if len > 32768 { len - 32768 } else { len };
            let start = u64::from(u32_at(e, 8)) | u64::from(u16_at(e, 6)) << 32;
            fs.add(r, start, len)?;
        } else {
            let leaf = u64::from(u32_at(e, 4)) | u64::from(u16_at(e, 8)) << 32;
            *budget = budget.checked_sub(1)?;
            fs.add(r, leaf, 1)?;
            let mut child = vec![0u8; fs.block as usize];
            fs.read_block(read, leaf, &mut child)?;
            extents(fs, read, r, &child, u32::from(depth) - 1, budget)?;
        }
    }
    Some(())
}

/// An indirect block of an ext2/3 block map, `depth` levels above the data blocks.
fn indirect(
    fs: &Fs,
    read: ReadFn,
    r: &mut Ranges,
    block: u64,
    depth: u32,
    budget: &mut usize,
) -> Option<()> {
    if block == 0 {
        return Some(());
    }
    *budget = budget.checked_sub(1)?;
    fs.add(r, block, 1)?;
    let mut b = vec![0u8; fs.block as usize];
    fs.read_block(read, block, &mut b)?;
    for p in b.chunks(4).map(|p| u64::from(u32_at(p, 0))) {
        if depth == 1 {
            add_nonzero(fs, r, p)?;
        } else {
            indirect(fs, read, r, p, depth - 1, budget)?;
        }
    }
    Some(())
}
