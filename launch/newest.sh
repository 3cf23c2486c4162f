#!/usr/bin/env bash
# The newest releases this machine's pip allows (launch/newest-constraints.txt), installed into .venv-newest and
# tested there: launch/versions.sh, which says what it runs. Arguments replace its test list.
exec bash "$(dirname "$0")/versions.sh" newest "$@"
