"""What every ``fdsched`` command shares, below the replay, serve and tools layers: the output folders a command
owns (:mod:`fdsched.cmdline.outdir`), keeping the host's chatter off the terminal (:mod:`fdsched.cmdline.quiet`) and
reading the plugin's per-arm series from a ``/metrics`` scrape (:mod:`fdsched.cmdline.scrape`).
Imports nothing from FastDeploy and nothing of the plugin but ``fdsched.core``."""
