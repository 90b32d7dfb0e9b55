#!/bin/bash
# reward 1 when /app/answer.txt holds the sum, else 0
if [ "$(cat /app/answer.txt 2>/dev/null)" = "7" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
