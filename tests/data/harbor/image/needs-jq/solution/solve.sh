#!/bin/bash
jq -r .name /app/person.json > /app/name.txt
