"""How a run lives and ends outside training itself: the supervisor that launches the ranks and relays their
output (`supervisor`, `console_relay`), the ranks' tie to it (`lifeline`), signals turned into a clean stop
(`stopping`), the output folder's lock (`run_lock`) and the process group's set-up and teardown (`process_group`)."""
