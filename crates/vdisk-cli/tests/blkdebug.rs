//! QEMU's blkdebug driver (`blkdebug:CONF:NAME`, `driver=blkdebug`) against qemu-img: the
//! same commands over the same images and rules fail (or not) with the same words and exit
//! status, and a malformed config file or rule list is refused as qemu-img refuses it.

mod common;

use common::{tools, Failures, Workdir};

/// Config files, good and malformed.
const CONFIGS: &[&str] = &[
    "[inject-error]\nevent = \"read_aio\"\nerrno = \"5\"\nonce = \"off\"\n",
    "[inject-error \"x\"]\nevent = \"read_aio\"\nerrno = \"28\"\nonce = \"on\"\n",
    "[set-state]\nevent = \"none\"\nnew_state = \"2\"\n[inject-error]\nevent = \"read_aio\"\nstate = \"2\"\n",
    "[inject-error]\nevent = \"read_aio\"\nstate = \"3\"\n",
    "[inject-error]\nevent = \"none\"\niotype = \"read\"\nsector = \"0\"\n",
    "# nothing\n",
    "",
    "event = \"read_aio\"\n",
    "[inject-error]\nevent = read_aio\n",
    "[inject-error]\nevent=\"none\"\n",
    "[inject-error]\n   \n",
    "[inject-error]\nerrno = \"5\"\n",
    "[inject-error]\nevent = \"nope\"\n",
    "[inject-error]\nevent = \"none\"\nerrno = \"x\"\n",
    "[inject-error]\nevent = \"none\"\nonce = \"maybe\"\n",
    "[inject-error]\nevent = \"none\"\niotype = \"wat\"\n",
    "[inject-error]\nevent = \"none\"\nsector = \"99999999999999999999\"\n",
    "[inject-error]\nevent = \"none\"\nsector = \"36028797018963968\"\n",
    "[inject-error]\nevent = \"none\"\nbogus = \"1\"\n",
    "[bogus]\nevent = \"none\"\n",
    "[inject-error\nevent = \"none\"\n",
    "[",
    "[]\n",
    "\u{0}\u{ff}[\n\"=\n",
];

#[test]
fn blkdebug_fails_requests_as_qemu_does() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "blkdebug");
    let mut f = Failures::new("blkdebug", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "x.qcow2", "4M"]);
    wd.setup_io(
        "x.qcow2",
        Some("qcow2"),
        &["write -P 1 0 64k", "write -P 2 1M 64k"],
    );
    wd.setup_img(&["convert", "-O", "qcow2", "x.qcow2", "y.qcow2"]);
    for (i, config) in CONFIGS.iter().enumerate() {
        std::fs::write(wd.abs("c.conf"), config).unwrap();
        for args in [
            vec!["compare", "blkdebug:c.conf:x.qcow2", "y.qcow2"],
            vec!["compare", "y.qcow2", "blkdebug:c.conf:x.qcow2"],
        ] {
            let (q, v) = (wd.qemu_img(&args), wd.vdisk(&args));
            f.same_outcome(&format!("config {i}"), &args.join(" "), &q, &v);
        }
    }
    // Names and options refused before any rule is read.
    for name in [
        "blkdebug:x.qcow2",
        "blkdebug:nope.conf:x.qcow2",
        "blkdebug::x.qcow2",
        "blkdebug::blkdebug::x.qcow2",
        "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':{'driver':'file','filename':'x.qcow2'},'align':3}}",
        "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':'nope','inject-error':[{'event':'none'}]}}",
        "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':{'driver':'file','filename':'x.qcow2'},'inject-error':[{'errno':5}]}}",
        "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':{'driver':'file','filename':'x.qcow2'},'inject-error':[{'event':'none','foo':1}]}}",
        "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':{'driver':'file','filename':'x.qcow2'},'bogus':1}}",
    ] {
        let args = ["compare", name, "y.qcow2"];
        let (q, v) = (wd.qemu_img(&args), wd.vdisk(&args));
        f.same_outcome(name, "compare", &q, &v);
    }
    // Over the whole format: reads and block status fail at the sectors named, and a
    // salvaging convert gives each up in qemu-img's order (iotest 251).
    let source = "json:{'driver':'blkdebug','image':{'driver':'qcow2','file':{'driver':'file',\
                  'filename':'x.qcow2'}},'inject-error':[\
                  {'event':'none','iotype':'block-status','errno':5,'sector':2050},\
                  {'event':'none','iotype':'read','errno':5,'sector':2100},\
                  {'event':'none','iotype':'read','errno':5,'sector':4},\
                  {'event':'none','iotype':'read','errno':5,'sector':5}]}";
    let salvage = |out: &str| ["convert", "--salvage", "-O", "raw", source, out].map(String::from);
    let (q, v) = (
        wd.qemu_img(&salvage("q.raw").each_ref().map(|a| a.as_str())),
        wd.vdisk(&salvage("v.raw").each_ref().map(|a| a.as_str())),
    );
    f.same_outcome("salvage", "convert --salvage", &q, &v);
    let same = wd.qemu_img(&["compare", "-f", "raw", "-F", "raw", "q.raw", "v.raw"]);
    if !f.count(same.success()) {
        f.add("salvage", "what was salvaged", format!("{same:?}"));
    }
    let map = [
        "map",
        "--image-opts",
        "driver=blkdebug,image.driver=qcow2,image.file.filename=x.qcow2,align=4k",
    ];
    f.same_outcome(
        "map",
        "map through blkdebug",
        &wd.qemu_img(&map),
        &wd.vdisk(&map),
    );
    // A commit into a backing file whose writes fail once with ENOSPC (iotest 020).
    for tool in ["qemu", "vdisk"] {
        let base = format!("{tool}.base");
        let top = format!("{tool}.top");
        wd.setup_img(&["create", "-q", "-f", "qcow2", &base, "1M"]);
        let backing = format!(
            "json:{{'driver':'qcow2','file':{{'driver':'blkdebug','inject-error':[{{\
             'event':'write_aio','errno':28,'once':true}}],'image':{{'driver':'file',\
             'filename':'{base}'}}}}}}"
        );
        wd.setup_img(&[
            "create", "-q", "-f", "qcow2", "-b", &backing, "-F", "qcow2", &top,
        ]);
        wd.setup_io(&top, Some("qcow2"), &["write -P 3 0 64k"]);
    }
    let (q, v) = (
        wd.qemu_img(&["commit", "qemu.top"]),
        wd.vdisk(&["commit", "vdisk.top"]),
    );
    f.same_text(
        "commit",
        "exit status",
        &format!("{:?}", q.code),
        &format!("{:?}", v.code),
    );
    f.same_text(
        "commit",
        "stderr",
        &q.stderr.replace("qemu-img:", "vdisk:"),
        &v.stderr,
    );
    f.finish();
}
