# rendered by polar_gym.apptainer.images (codex @openai/codex@0.169.0 on docker://swebench/sweb.eval.x86_64.astropy__astropy-12907:latest); build context: this file's directory
FROM swebench/sweb.eval.x86_64.astropy__astropy-12907:latest
LABEL org.polar_gym.base="docker://swebench/sweb.eval.x86_64.astropy__astropy-12907:latest"
LABEL org.polar_gym.key="0000000000000000"
LABEL org.polar_gym.harness="codex"
LABEL org.polar_gym.harness.package="@openai/codex"
LABEL org.polar_gym.harness.version="0.169.0"
LABEL org.polar_gym.node="22.12.0"
ENV PATH="/opt/node/bin:$PATH"
COPY polar-setup.sh /tmp/polar-setup.sh
RUN sh /tmp/polar-setup.sh && rm /tmp/polar-setup.sh
WORKDIR /testbed
