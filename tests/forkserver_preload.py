"""First module the test forkserver (tests/cli_forkserver.py) imports: the CLI's warning filters, which
`megatron_rl.cli.main` sets before any import of a dependency, so that the server's imports stay as quiet as a fresh
trainer's (its children inherit these filters, and main() sets the same ones again)."""
from megatron_rl.cli import _quiet_known_upstream_warnings

_quiet_known_upstream_warnings()
