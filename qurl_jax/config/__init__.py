"""Configuration: the documented base config, validation, command-line overrides, the saved run
config, and the typed settings the layers below read (a validated `ConfigDict` converted once).

Nothing below this package takes a `ConfigDict`; it imports nothing from `plan`, `train` or
`study`."""
