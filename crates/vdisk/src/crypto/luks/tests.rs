use super::*;

fn quick() -> Params {
    Params {
        iter_time: 1,
        ..Params::default()
    }
}

fn reader(img: &[u8]) -> impl FnMut(u64, &mut [u8]) -> Result<()> + '_ {
    move |at, buf| {
        let at = at as usize;
        let src = img
            .get(at..at + buf.len())
            .ok_or_else(|| Error::corrupt("past the end"))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn created_header_unlocks_with_its_password_only() {
    let (img, cipher) = Luks::create(&quick(), b"123456").unwrap();
    assert_eq!(img.len(), 2068480);
    let luks = Luks::parse(&img).unwrap();
    assert_eq!(luks.region_len(), 2068480);
    assert_eq!(luks.aes_bits(), 256);
    let got = luks.unlock(b"123456", &mut reader(&img)).unwrap();
    let mut a = vec![7u8; 1024];
    let mut b = a.clone();
    cipher.encrypt(3, &mut a).unwrap();
    got.encrypt(3, &mut b).unwrap();
    assert_eq!(a, b);
    let wrong = luks.unlock(b"654321", &mut reader(&img)).unwrap_err();
    assert_eq!(
        wrong.to_string(),
        "Invalid password, cannot unlock any keyslot"
    );
}

#[test]
fn damaged_headers_give_errors_not_panics() {
    let (img, _) = Luks::create(&quick(), b"pw").unwrap();
    // Truncations, every byte of the header flipped, and fields set to extremes.
    for len in [0, 5, 100, HEADER_LEN - 1] {
        assert!(Luks::parse(&img[..len]).is_err());
    }
    // Iteration counts are left alone: a huge one is valid, only slow.
    let iterations =
        |at: usize| (164..168).contains(&at) || (at >= 208 && (at - 208) % 48 / 4 == 1);
    for at in (0..HEADER_LEN).filter(|&at| !iterations(at)) {
        for v in [0xff, img[at] ^ 0x80] {
            let mut bad = img.clone();
            bad[at] = v;
            if let Ok(l) = Luks::parse(&bad) {
                // What parses must still fail or succeed cleanly when unlocked.
                let _ = l.unlock(b"pw", &mut reader(&bad));
            }
        }
    }
    let mut bad = img.clone();
    bad[208..212].copy_from_slice(&1u32.to_be_bytes());
    let e = Luks::parse(&bad).unwrap_err().to_string();
    assert!(e.contains("Keyslot 0 state"), "{e}");
    let mut bad = img.clone();
    bad[108..112].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(Luks::parse(&bad).is_err());
}
