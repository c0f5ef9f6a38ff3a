#!/usr/bin/env bash
# Set up (.venv) and run the main job: every available backend against the reference.
source "$(dirname "$0")/_venv.sh"
packattn demo "$@"
