//! The superblock's and batch header's encoding, tested.

use super::*;

fn sb() -> Superblock {
    Superblock {
        block_size: 4096,
        segment_blocks: 256,
        disk_size: 64 << 20,
        capacity: 64 << 20,
        resizable: false,
        segments: 40,
        image_id: 0x1234_5678_9abc_def0,
        policy: Policy::Greedy,
        checkpoints: true,
        holds: None,
        streams: true,
        cold: true,
        map_memory: 0,
        opens: true,
    }
}

#[test]
fn superblock_round_trip_and_damage() {
    let s = sb();
    let b = s.encode();
    assert_eq!(Superblock::decode(&b).unwrap(), s);
    let layout = Superblock {
        disk_size: 8 << 20,
        resizable: true,
        holds: Some(Held::Qcow2),
        map_memory: 3 << 12,
        ..s
    };
    assert_eq!(Superblock::decode(&layout.encode()).unwrap(), layout);
    // A held format vdisk does not know is refused, not opened as a plain disk.
    let mut unknown = layout.encode();
    unknown[49] = 9;
    let crc = crc32c(0, &unknown[..SUPER_LEN - 4]);
    unknown[SUPER_LEN - 4..SUPER_LEN].copy_from_slice(&crc.to_le_bytes());
    assert!(Superblock::decode(&unknown).is_err());
    for at in [9, 17, 25, 41, 48, 63, 66, 73] {
        let mut bad = layout.encode();
        bad[at] ^= 1;
        assert!(Superblock::decode(&bad).is_err(), "byte {at} flipped");
    }
    // Geometries whose memory would not fit are refused, not allocated.
    for bad in [
        Superblock {
            block_size: 3000,
            ..s
        },
        Superblock {
            segment_blocks: 1 << 30,
            segments: 2,
            ..s
        },
        Superblock {
            disk_size: 1 << 50,
            capacity: 1 << 50,
            ..s
        },
        Superblock {
            disk_size: 128 << 20,
            resizable: true,
            ..s
        },
        Superblock {
            capacity: 32 << 20,
            resizable: true,
            ..s
        },
    ] {
        assert!(Superblock::decode(&bad.encode()).is_err(), "{bad:?}");
    }
    assert_eq!(s.log_offset(0), 1 << 20);
    assert_eq!(s.max_records(), 253);
}

#[test]
fn batch_round_trip_and_checksum() {
    let h = BatchHeader {
        seq: 7,
        nonce: 99,
        image_id: 5,
        stream: 0,
        records: vec![
            Record {
                block: 10,
                count: 2,
                kind: Kind::Data,
            },
            Record {
                block: 1 << 40,
                count: 9,
                kind: Kind::Trim,
            },
        ],
    };
    let data = vec![0xabu8; 8192];
    let mut block = vec![0u8; 4096];
    h.encode(&mut block, &data);
    let (back, blocks) = BatchHeader::decode(&block, 5, 253).unwrap();
    assert_eq!((back, blocks), (h, 2));
    assert!(BatchHeader::verify(&block, &data));
    let mut torn = data.clone();
    torn[5000] = 0;
    assert!(!BatchHeader::verify(&block, &torn));
    assert_eq!(
        BatchHeader::decode(&block, 6, 253).unwrap_err(),
        BadBatch::NotABatch
    );
    block[32] = 3;
    assert!(matches!(
        BatchHeader::decode(&block, 5, 253),
        Err(BadBatch::Damaged(_))
    ));
}
