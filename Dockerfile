# The image the Helm chart runs: the operator and the node agent are console scripts of the one
# offloadpool distribution. (Not built in CI: the development machines have no container engine.)
FROM python:3.11-slim
COPY . /src
RUN pip install --no-cache-dir '/src[operator]' && rm -rf /src
# The agent mounts through mount(2) via ctypes and needs nothing else from the OS.
ENTRYPOINT []
CMD ["offloadpool-operator", "--standalone"]
