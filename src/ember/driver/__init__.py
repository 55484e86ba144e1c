"""The top layer under the CLI: drives the stages to do what a command asks.

`compiler` (frontend -> ir_passes -> schedules -> artifact), `codegen`, `convert` (weights),
`tune` and `farm` (meta_schedule, locally or through an RPC tracker), `bench`, `package`
(artifact + runtime for a device) and `analyze` (rooflines). It may import every stage;
no stage imports it.
"""
