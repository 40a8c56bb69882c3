#!/usr/bin/env bash
# Run `offloadpool bench populate "$@"` on a virtual machine with its memory held the way a
# bare-metal node holds it, then put the machine back as it was.
#
# Why: a VM with free page reporting (virtio-balloon) hands freed memory back to its host, and
# the next touch of it waits for the host to back it again. Every case of the bench frees the
# memory its next run takes again, so how much of it the host took back in between decides a
# run's time more than what the run does (single runs move 2x to 20x, docs/bench-populate.md).
# A GPU node has no host behind it. So, for the run only:
#   1. free page reporting waits the longest this kernel allows before handing freed memory
#      back (`min_free_ms`, a knob some hypervisors' guest kernels have; skipped where absent):
#      the memory a case frees is still backed when the next run takes it;
#   2. 2 MiB huge pages sitting free in the kernel's persistent pool (hack/hugepages.py leaves
#      the tests' there) return to the free memory, so no case has to reclaim page cache to fit
#      (the bench itself puts into the pool what each huge-page case needs, and takes it out).
# The run records the knobs it ran under (`machine.free_page_reporting` in its JSON).
set -euo pipefail

[[ $(id -u) == 0 ]] || { echo "hack/bench-populate-vm.sh: needs root (it writes kernel knobs)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
bench=("$here/.venv/bin/offloadpool" bench populate "$@")
[[ -x ${bench[0]} ]] || bench=(offloadpool bench populate "$@")

knob=/sys/module/page_reporting/parameters/min_free_ms
pool=/sys/kernel/mm/hugepages/hugepages-2048kB
old_knob= old_pool=
restore() {
    if [[ -n $old_knob ]]; then echo "$old_knob" >"$knob"; fi
    if [[ -n $old_pool ]]; then echo "$old_pool" >"$pool/nr_hugepages"; fi
}
trap restore EXIT

if [[ -w $knob ]]; then
    old_knob=$(cat "$knob")
    for ms in 300000 120000 60000; do  # the longest this kernel accepts
        if echo "$ms" >"$knob" 2>/dev/null; then break; fi
    done
    echo "free page reporting: min_free_ms $old_knob -> $(cat "$knob") for the run" >&2
fi
if [[ -d $pool ]] && (( $(cat "$pool/free_hugepages") == $(cat "$pool/nr_hugepages") )) \
    && (( $(cat "$pool/resv_hugepages") == 0 )); then
    old_pool=$(cat "$pool/nr_hugepages")
    echo 0 >"$pool/nr_hugepages"
    echo "2 MiB huge page pool: $old_pool free pages -> 0 for the run" >&2
fi
"${bench[@]}"
