"""`blockdraft doctor`: tells, in numbers, whether bad acceptance is the drafter's fault or the deployment's.

Every source of evidence (a live server, a log line, numbers a user types, an offline probe) becomes one
`Fingerprint`; static checks become `Finding`s; `diagnose` compares fingerprints; `report` renders it all.
"""
