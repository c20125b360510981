"""The `nvrx` command line: parse, build the config once, call into the launcher."""
