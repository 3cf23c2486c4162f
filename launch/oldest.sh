#!/usr/bin/env bash
# The lowest releases setup.cfg declares (launch/oldest-constraints.txt), installed into .venv-oldest and tested
# there: launch/versions.sh, which says what it runs. Arguments replace its test list.
exec bash "$(dirname "$0")/versions.sh" oldest "$@"
