#!/bin/bash
echo "Hello, Harbor!" > /app/greeting.txt
