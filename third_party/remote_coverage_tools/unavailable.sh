#!/bin/sh
# Stands in for Bazel's coverage tools, which are downloaded on demand and unavailable offline.
echo "hfjax: 'bazel coverage' is not supported (the coverage tools would have to be" \
  "downloaded); run tests with 'bazel test' or measure coverage under pytest." >&2
exit 1
