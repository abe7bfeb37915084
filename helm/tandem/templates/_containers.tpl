{{/* The worker containers and the engine settings they read from the ConfigMap. */}}

{{/* Settings from the engine ConfigMap, as environment the args refer to. dict: root, role */}}
{{- define "tandem.engineEnv" -}}
{{- $cm := include "tandem.componentName" (dict "root" .root "component" "engine") }}
{{- range $key := include "tandem.engineKeys" . | fromJsonArray }}
- name: {{ printf "TANDEM_%s" ($key | upper | replace "-" "_" | replace "." "_") }}
  valueFrom:
    configMapKeyRef:
      name: {{ $cm }}
      key: {{ $key }}
{{- end }}
{{- end }}

{{/* Keys of the engine ConfigMap that a role's container reads. dict: root, role */}}
{{- define "tandem.engineKeys" -}}
{{- $v := index .root.Values .role }}
{{- $keys := list (printf "%s.dtype" .role) (printf "%s.block-size" .role) (printf "%s.max-num-seqs" .role) }}
{{- if .root.Values.engine.maxModelLen }}{{ $keys = append $keys (printf "%s.max-model-len" .role) }}{{ end }}
{{- if $v.engine.kvCacheMemory }}{{ $keys = append $keys (printf "%s.kv-cache-memory" .role) }}{{ end }}
{{- if $v.engine.threads }}{{ $keys = append $keys (printf "%s.threads" .role) }}{{ end }}
{{- if gt (int $v.engine.tensorParallelSize) 1 }}{{ $keys = append $keys (printf "%s.tensor-parallel-size" .role) }}{{ end }}
{{- if gt (int $v.engine.dataParallelSize) 1 }}{{ $keys = append $keys (printf "%s.data-parallel-size" .role) }}{{ end }}
{{- if $v.draft.enabled }}{{ $keys = append $keys (printf "%s.draft" .role) }}{{ end }}
{{- if or $v.draft.enabled $v.draft.method }}{{ $keys = append $keys (printf "%s.num-draft-tokens" .role) }}{{ end }}
{{- toJson $keys }}
{{- end }}

{{/* A worker container (prefill or decode): the CLI's flags, the engine settings from the
ConfigMap ($(TANDEM_...) is expanded by the kubelet), probes and the drain. dict: root, role */}}
{{- define "tandem.workerContainer" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $env := printf "TANDEM_%s_" ($role | upper) }}
- name: {{ $role }}
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: [tandem]
  args:
    - {{ $role }}
    - --model={{ include "tandem.modelPath" $root }}
    - --served-model-name={{ $root.Values.model.servedName }}
    - --dtype=$({{ $env }}DTYPE)
    - --block-size=$({{ $env }}BLOCK_SIZE)
    - --max-num-seqs=$({{ $env }}MAX_NUM_SEQS)
    {{- if $root.Values.engine.maxModelLen }}
    - --max-model-len=$({{ $env }}MAX_MODEL_LEN)
    {{- end }}
    {{- if $v.engine.kvCacheMemory }}
    - --kv-cache-memory=$({{ $env }}KV_CACHE_MEMORY)
    {{- end }}
    {{- if $v.engine.threads }}
    - --threads=$({{ $env }}THREADS)
    {{- end }}
    {{- if gt (int $v.engine.tensorParallelSize) 1 }}
    - --tensor-parallel-size=$({{ $env }}TENSOR_PARALLEL_SIZE)
    {{- end }}
    {{- if gt (int $v.engine.dataParallelSize) 1 }}
    - --data-parallel-size=$({{ $env }}DATA_PARALLEL_SIZE)
    {{- end }}
    {{- if $v.engine.expertParallel }}
    - --enable-expert-parallel
    {{- end }}
    {{- if $v.engine.eager }}
    - --eager
    {{- end }}
    {{- if $v.draft.enabled }}
    - --draft=$({{ $env }}DRAFT)
    {{- end }}
    {{- with $v.draft.method }}
    - --draft-method={{ . }}
    {{- end }}
    {{- if or $v.draft.enabled $v.draft.method }}
    - --num-draft-tokens=$({{ $env }}NUM_DRAFT_TOKENS)
    {{- if not $v.draft.adaptive }}
    - --no-adaptive-speculation
    {{- end }}
    {{- end }}
    {{- include "tandem.serviceArgs" (dict "root" $root "role" $role) | trim | nindent 4 }}
    {{- if eq $role "prefill" }}
    - --max-queued={{ $v.maxQueued }}
    {{- else }}
    - --reserve-timeout-s={{ $v.reserveTimeoutSeconds }}
    {{- end }}
    - --kv-transport=auto
    - --engine-stall-s={{ $v.probes.engineStallSeconds }}
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- include "tandem.env" $root | trim | nindent 4 }}
    {{- include "tandem.engineEnv" (dict "root" $root "role" $role) | trim | nindent 4 }}
  ports:
    - name: grpc
      containerPort: {{ $v.ports.grpc }}
      protocol: TCP
    - name: metrics
      containerPort: {{ $v.ports.metrics }}
      protocol: TCP
  {{- $service := ternary "tandem.v1.PrefillWorker" "tandem.v1.DecodeWorker" (eq $role "prefill") }}
  {{- include "tandem.probes" (dict "root" $root "role" $role "service" $service) | trim | nindent 2 }}
  {{- include "tandem.lifecycle" $v | trim | nindent 2 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  resources:
    {{- include "tandem.workerResources" (dict "root" $root "role" $role) | trim | nindent 4 }}
  volumeMounts:
    {{- include "tandem.volumeMounts" (dict "root" $root "role" $role) | trim | nindent 4 }}
{{- end }}


{{/* A worker's resources: the role's, and on the CUDA image one GPU per rank (nvidia.com/gpu,
requests and limits): engine.tensorParallelSize times engine.dataParallelSize. A count given in
resources that differs from it is refused. Resources that name other NVIDIA devices (MIG
slices: nvidia.com/mig-...) are left as given at one rank and refused at more. dict: root, role */}}
{{- define "tandem.workerResources" -}}
{{- $v := index .root.Values .role }}
{{- $resources := deepCopy $v.resources }}
{{- if eq .root.Values.image.flavor "cuda" }}
{{- $gpus := mul (int $v.engine.tensorParallelSize) (int $v.engine.dataParallelSize) }}
{{- $others := list }}
{{- range $kind := list "requests" "limits" }}
{{- range $name, $_ := index $resources $kind | default dict }}
{{- if and (hasPrefix "nvidia.com/" $name) (ne $name "nvidia.com/gpu") }}{{ $others = append $others $name }}{{ end }}
{{- end }}
{{- end }}
{{- if $others }}
{{- if gt $gpus 1 }}
{{- fail (printf "%s.engine.tensorParallelSize x dataParallelSize: %d ranks need whole GPUs (nvidia.com/gpu), but %s.resources name %s" .role $gpus .role (first $others)) }}
{{- end }}
{{- else }}
{{- range $kind := list "requests" "limits" }}
{{- $given := index $resources $kind | default dict }}
{{- if hasKey $given "nvidia.com/gpu" }}
{{- if ne (int (index $given "nvidia.com/gpu")) $gpus }}
{{- fail (printf "%s.resources.%s.nvidia.com/gpu: %v, but %s.engine.tensorParallelSize x dataParallelSize is %d (one GPU per rank); set one of them" $.role $kind (index $given "nvidia.com/gpu") $.role $gpus) }}
{{- end }}
{{- end }}
{{- $_ := set $given "nvidia.com/gpu" $gpus }}
{{- $_ := set $resources $kind $given }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $resources }}
{{- end }}
