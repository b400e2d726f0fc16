//! Commands that write, given json: and option names, and qcow2's data-file option.

use crate::common::{tools, Failures, Workdir};
use crate::{chain, same};

/// qcow2's `data-file` option names the external data file: also of an image whose name for
/// it `amend -o data_file=` dropped, which then opens only so.
#[test]
fn data_file_options_name_the_data_file_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-data-file");
    let mut f = Failures::new("image-names-data-file", &wd);
    let mut infos = Vec::new();
    for tool in ["q", "v"] {
        let (image, data) = (format!("{tool}.qcow2"), format!("{tool}.data"));
        let o = format!("data_file={data}");
        wd.setup_img(&["create", "-q", "-f", "qcow2", "-o", &o, &image, "1M"]);
        wd.setup_io(&image, None, &["write -P 3 0 64k"]);
        let opts = format!("data-file.filename={data},file.filename={image}");
        let amend = ["amend", "-o", "data_file=", "--image-opts", &opts];
        let out = if tool == "q" {
            wd.qemu_img(&amend)
        } else {
            wd.vdisk(&amend)
        };
        assert!(out.success(), "{out:?}");
        let info = wd.qemu_img(&["info", "--image-opts", &opts]).stdout;
        infos.push(info.replace(&image, "IMAGE").replace(&data, "DATA"));
        for args in [
            &["info", "--image-opts", &opts][..],
            &["map", "--output=json", "--image-opts", &opts],
            &["compare", "--image-opts", &opts, &opts],
            &["info", &image],
            &["map", &image],
        ] {
            same(&mut f, &wd, &image, args);
        }
    }
    f.same_text("amend -o data_file=", "info", &infos[0], &infos[1]);
    f.finish();
}

/// Commands that write, given `json:` and `--image-opts` names: each tool works on its own
/// copy of the same chain, and the images they leave are compared.
#[test]
fn writes_through_option_names_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-write");
    let mut f = Failures::new("image-names-write", &wd);
    let steps: &[(&str, &[&str])] = &[
        (
            "commit",
            &["commit", "--image-opts", "driver=qcow2,file.filename=TOP"],
        ),
        (
            "commit json",
            &["commit", r#"json:{"file.filename":"TOP"}"#],
        ),
        (
            "resize",
            &[
                "resize",
                "--image-opts",
                "driver=qcow2,file.filename=TOP",
                "2M",
            ],
        ),
        (
            "snapshot",
            &["snapshot", "-c", "s1", r#"json:{"file.filename":"TOP"}"#],
        ),
        (
            "amend",
            &[
                "amend",
                "-o",
                "lazy_refcounts=on",
                "--image-opts",
                "file.filename=TOP",
            ],
        ),
        (
            "rebase",
            &[
                "rebase",
                "-b",
                "other.qcow2",
                "-F",
                "qcow2",
                r#"json:{"file.filename":"TOP"}"#,
            ],
        ),
        (
            "convert -n",
            &[
                "convert",
                "-n",
                "--image-opts",
                "--target-image-opts",
                "driver=qcow2,file.filename=TOP",
                "driver=raw,file.filename=out.raw",
            ],
        ),
        (
            "convert",
            &[
                "convert",
                "-O",
                "qcow2",
                r#"json:{"file.filename":"TOP"}"#,
                "file:out.qcow2",
            ],
        ),
        (
            "dd",
            &[
                "dd",
                "--image-opts",
                "if=driver=qcow2,file.filename=TOP",
                "of=out.raw",
                "bs=64k",
            ],
        ),
    ];
    for (what, args) in steps {
        let mut results = Vec::new();
        for tool in ["q", "v"] {
            let (base, top) = (format!("{tool}-base.qcow2"), format!("{tool}.qcow2"));
            chain(&wd, &base, &top);
            wd.setup_img(&["create", "-q", "-f", "qcow2", "other.qcow2", "1M"]);
            wd.setup_img(&["create", "-q", "-f", "raw", "out.raw", "1M"]);
            let args: Vec<String> = args.iter().map(|a| a.replace("TOP", &top)).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = match tool {
                "q" => wd.qemu_img(&args),
                _ => wd.vdisk(&args),
            };
            let mut state = format!("exit {:?}\n{}", out.code, out.stdout);
            for (image, fmt) in [(&top, "qcow2"), (&base, "qcow2")] {
                state += &wd.map_extents(image, fmt);
            }
            let info = wd.qemu_img(&["info", "--output=json", &top]).stdout;
            let v: serde_json::Value = serde_json::from_str(&info).unwrap();
            let data = &v["format-specific"]["data"];
            state += &format!(
                "size {} backing {} lazy refcounts {}\n",
                v["virtual-size"], v["backing-filename"], data["lazy-refcounts"]
            );
            for (out, fmt) in [("out.raw", "raw"), ("out.qcow2", "qcow2")] {
                if wd.abs(out).exists() {
                    state += &wd.map_extents(out, fmt);
                    std::fs::remove_file(wd.abs(out)).unwrap();
                }
            }
            results.push(state.replace(&top, "T").replace(&base, "B"));
        }
        f.same_text(what, "images left", &results[0], &results[1]);
    }
    f.finish();
}
