# Sourced by bench/seqlog-syncs.sh and bench/seqlog-submits.sh, which compare two builds the
# same way: their options (--vdisk and --baseline required) into size_mib, depth, rounds, out,
# vdisk, baseline, and `args`, the command line for the report.
name=$(basename "$0")
args=$*
size_mib=1024 depth=32 rounds=2 out= vdisk= baseline=
while (($#)); do
    case $1 in
    --size-mib) size_mib=$2; shift ;;
    --depth) depth=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --out) out=$2; shift ;;
    --vdisk) vdisk=$(realpath "$2"); shift ;;
    --baseline) baseline=$(realpath "$2"); shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "$name: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[[ -n $vdisk && -n $baseline ]] || { echo "$name: needs --vdisk and --baseline" >&2; exit 2; }
