#!/usr/bin/env bash
# Reverts each safety rule of docs/state-machine.md ("What the world does
# around a migration") once, in a worktree of its own, and runs what guards
# it: the simulation's schedules and the machine's unit tests. Every rule's
# proof must fail with the rule reverted; the summary says which did.
#   tools/mutate/run.sh [output file]      (about 3-6 minutes a rule on 2 cores)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/target/mutations.txt}
export PATH="$PATH:$HOME/.cargo/bin" CARGO_INCREMENTAL=0
# A target directory of its own: worktrees of one workspace share artifact
# names, and the product's would be overwritten with mutated code.
export CARGO_TARGET_DIR=${MUTATE_TARGET_DIR:-$HOME/.cache/vmmigrate/cargo-target-mutate}
work=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$work" >/dev/null 2>&1 || true' EXIT
git -C "$repo" worktree add -q --detach "$work" HEAD
cd "$work"
mkdir -p "$(dirname "$out")"; : >"$out"
mutant() { # name file old new
  git checkout -q -- .
  python3 - "$2" "$3" "$4" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if old not in text:
    sys.exit(f"{path}: the code to revert is not there any more: {old[:60]!r}")
open(path, "w").write(text.replace(old, new, 1))
PY
  sim=$(VMMIGRATE_SIM_SCHEDULES=2000 timeout 900 cargo test -q --test integration machine_simulation 2>&1 | grep -E "schedules broke|^seed" | head -2 | tr '\n' ' ' || true)
  unit=$(timeout 900 cargo test -q --lib machine 2>&1 | grep -E -- "--- FAILED" | tr '\n' ' ' || true)
  { echo "## $1"; echo "simulation: ${sim:-passes}"; echo "unit tests: ${unit:-pass}"; } >>"$out"
}
mutant "copies carry their epoch (stale() always false)" src/machine/power.rs "matches!(copy, CopyState::Complete { epoch, .. } if *epoch != ctx.status.epoch && Some(*epoch) != snapshot)" "{ let _ = (snapshot, copy); false }"
mutant "a source on again ends the epoch in Preparing (old: stop for a person, copies kept)" src/machine/mod.rs "seen if already_off => return end_epoch(ctx, seen)," "_ if already_off => return ctx.fail(Phase::Preparing, Failure::needs_human(Reason::SourcePoweredOnAgain, \"on again\")),"
mutant "an ended epoch begins a new one (no bump in end_epoch)" src/machine/power.rs "    ctx.status.epoch += 1;
    ctx.actions.push(Action::CleanupStaging);" "    ctx.actions.push(Action::CleanupStaging);"
mutant "the source is read after Preparing (observe_source returns None)" src/controller/engine.rs "    let status = vmm.status.as_ref()?;
    // In Starting only" "    let status = vmm.status.as_ref().filter(|_| false)?;
    // In Starting only"
mutant "the inventory is compared at the cutover (source_unchanged always true)" src/machine/power.rs "    let Some(recorded) = ctx.status.source_inventory.clone() else { return true };" "    let Some(recorded) = ctx.status.source_inventory.clone().filter(|_| false) else { return true };"
mutant "power actions are written ahead (no fence call)" src/controller/engine.rs "    let mut fence_passed = false;" "    let mut fence_passed = true;"
mutant "a refusing fence stops the step (refusal ignored)" src/controller/engine.rs "                tracing::warn!(?action, reason = %failure.reason, \"not performed: {}\", failure.message);
                return None;" "                tracing::warn!(?action, reason = %failure.reason, \"not performed: {}\", failure.message);"
mutant "the destination starts only with the source seen off (source_seen_off always true)" src/machine/mod.rs "    if ctx.spec.mode == MigrationMode::Rehearsal {
        return true;
    }
    let failure" "    if ctx.spec.mode == MigrationMode::Rehearsal || ctx.now_ts.as_second() > 0 {
        return true;
    }
    let failure"
mutant "transport errors spend no budget (is_transport always false)" src/api/reason.rs "    pub fn is_transport(self) -> bool {
        matches!(" "    pub fn is_transport(self) -> bool {
        false && matches!("
mutant "after a power-off nothing automatic deletes the copies (finish deletes)" src/machine/mod.rs "        if !completed && !rehearsal && self.status.timestamps.source_powered_off.is_some() {" "        if !completed && !rehearsal && self.status.timestamps.source_powered_off.is_some() && self.now_ts.as_second() < 0 {"
mutant "orphans hold before the cutover (hold ignored in Preparing)" src/machine/mod.rs "            let gate = match input.orphan_hold {" "            let gate = match input.orphan_hold && input.now.as_second() < 0 {"
mutant "shutdown timeout on the local clock (local clock ignored)" src/machine/power.rs "        && ctx.shutdown_seen_for.is_none_or(|local| local >= timeout);" "        && ctx.shutdown_seen_for.is_none_or(|_| true);"
echo "written: $out"
