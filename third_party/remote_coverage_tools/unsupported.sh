#!/bin/sh
echo "attnd: coverage through Bazel is not supported (offline build)" >&2
exit 1
