"""A fix written for another signature of a real upstream function: what a bumped upstream looks
like to an unchanged fix. Tests add it to the register (`ENTRY`) in a child process; importing
this module imports nothing upstream, like a real fix module's register entry."""

from sglang_dsv4.fix import Fix, Replace
from sglang_dsv4.fixes import Entry

POOL_MODULE = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
# A pool function no real fix replaces (a second replacement of one target is its own refusal).
TARGET = f"{POOL_MODULE}.get_swa_ring_size"


def get_swa_ring_size(sliding_window):
    return 0


FIX = Fix(
    id="broken-fix",
    title="t",
    area="test",
    why="w",
    how="h",
    upstream="not upstream",
    remove_when="never",
    targets=(TARGET,),
    replaces=(Replace(TARGET, get_swa_ring_size, "(sliding_window)"),),
)

ENTRY = Entry(__name__, (POOL_MODULE,))


def register() -> None:
    import sglang_dsv4.fixes as fixes

    fixes.REGISTER = fixes.REGISTER + (ENTRY,)


def scheduler(pipe_writer) -> None:
    """What a scheduler process does first (upstream's run_scheduler_process): load the plugins,
    then import the model's modules (the DeepSeek-V4 pool), then report ready."""
    register()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.mem_cache.deepseek_v4_memory_pool  # noqa: F401

    pipe_writer.send({"status": "ready"})
