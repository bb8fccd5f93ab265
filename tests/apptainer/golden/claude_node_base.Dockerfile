# rendered by polar_gym.apptainer.images (claude_code @anthropic-ai/claude-code@2.1.197 on docker://node:22-bookworm); build context: this file's directory
FROM node:22-bookworm
LABEL org.polar_gym.base="docker://node:22-bookworm"
LABEL org.polar_gym.key="0000000000000000"
LABEL org.polar_gym.harness="claude_code"
LABEL org.polar_gym.harness.package="@anthropic-ai/claude-code"
LABEL org.polar_gym.harness.version="2.1.197"
ENV LANG="C.UTF-8"
ENV QUOTED="a \"b\" $HOME"
COPY polar-setup.sh /tmp/polar-setup.sh
RUN sh /tmp/polar-setup.sh && rm /tmp/polar-setup.sh
WORKDIR /workspace
